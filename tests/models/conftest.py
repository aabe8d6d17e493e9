"""The model tests' fixtures (shared with the engine and tensor-parallel tests: ``tiny_models``)."""

from tiny_models import ckpt_root, one_thread  # noqa: F401
