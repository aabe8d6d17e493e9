"""portattn: device-portable paged attention for LLM and VLM serving."""

from ._version import __version__ as __version__
from .cascade import cascade_attention, merge_attention_states
from .errors import OutOfPagesError, UnsupportedFeatureError
from .local_attention import LocalAttentionBatches, make_local_attention_virtual_batches
from .mla import mla_decode, mla_workspace_size
from .ops import paged_attention, varlen_attention
from .paging import PageAllocator, PageTable, to_page_table


def __getattr__(name: str):
    # The engine pulls in transformers; import it only when asked for.
    if name in ("LLM", "SamplingParams", "RequestOutput", "CompletionOutput"):
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "LLM",
    "CompletionOutput",
    "LocalAttentionBatches",
    "OutOfPagesError",
    "PageAllocator",
    "PageTable",
    "RequestOutput",
    "SamplingParams",
    "UnsupportedFeatureError",
    "cascade_attention",
    "make_local_attention_virtual_batches",
    "merge_attention_states",
    "mla_decode",
    "mla_workspace_size",
    "paged_attention",
    "to_page_table",
    "varlen_attention",
]
