"""The serving benchmark runs against the server tests' tiny served model."""

from server.conftest import model_root, served  # noqa: F401
