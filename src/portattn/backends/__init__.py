"""Attention backends: the protocol (base), the registry, and the implementations."""

from .base import AttentionBackend, AttentionParams, Capabilities, Request
from .metadata import PagedMetadata, VarlenMetadata
from .registry import available_backends, register_backend, registered_backends, select_backend

__all__ = [
    "AttentionBackend",
    "AttentionParams",
    "Capabilities",
    "PagedMetadata",
    "Request",
    "VarlenMetadata",
    "available_backends",
    "register_backend",
    "registered_backends",
    "select_backend",
]
