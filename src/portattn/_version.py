"""The package version, in a module every floor may import (``portattn.__version__`` re-exports it)."""

__version__ = "0.1.0"
