"""The page allocator under exceptions at every line: each call changes the pool completely or not at
all. And page tables that know what they are."""

from __future__ import annotations

import sys
from collections import Counter

import pytest
import torch

from portattn import PageAllocator, PageTable, paging, to_page_table


def interrupt_at(line: int, hit: int):
    """A tracer raising ``KeyboardInterrupt`` at hit ``hit`` of ``paging.py`` line ``line``; records lines."""
    hits: Counter = Counter()

    def tracer(frame, event, arg):
        if frame.f_code.co_filename != paging.__file__:
            return None
        if event == "line":
            hits[frame.f_lineno] += 1
            if frame.f_lineno == line and hits[line] == hit:
                raise KeyboardInterrupt
        return tracer

    return tracer, hits


def state(alloc: PageAllocator) -> tuple:
    refs = [alloc.ref_count(p) for p in range(alloc.num_pages)]
    return list(alloc._free), refs, list(alloc._cached), alloc.num_evictable


def fresh() -> PageAllocator:
    """Page 0 held once, 1 by a sequence and the cache, 2 by the cache alone, 3 twice, 4-7 free."""
    alloc = PageAllocator(8)
    alloc.allocate(4)
    alloc.retain([3])
    alloc.retain([1, 2], cached=True)
    alloc.free([2])
    return alloc


CALLS = {
    "allocate": lambda a: a.allocate(3),
    "retain": lambda a: a.retain([0, 2, 0]),
    "free": lambda a: a.free([1, 3, 3, 0]),
    "retain cached": lambda a: a.retain([0, 3], cached=True),
    "free cached": lambda a: a.free([1, 2], cached=True),
}


def test_pages_the_cache_alone_holds_are_counted_as_holds_change():
    alloc = fresh()
    assert alloc.num_evictable == 1 and alloc.num_used == 4  # page 2
    alloc.free([1])  # the sequence lets go of page 1: the cache alone holds it
    assert alloc.num_evictable == 2
    alloc.retain([2])  # a sequence takes page 2 from the cache (a prefix hit)
    assert alloc.num_evictable == 1
    alloc.free([1], cached=True)  # the cache drops page 1: back to the pool
    assert alloc.num_evictable == 0 and alloc.ref_count(1) == 0 and alloc.num_free == 5
    assert alloc.allocate(1) == [1] and alloc.num_evictable == 0  # not cached when handed out again
    with pytest.raises(ValueError, match="page 2 is cached already"):
        alloc.retain([2], cached=True)
    with pytest.raises(ValueError, match="page 3 is not cached"):
        alloc.free([3], cached=True)
    with pytest.raises(ValueError, match="expected distinct pages for the cache to hold"):
        alloc.retain([3, 3], cached=True)
    with pytest.raises(ValueError, match="page 2 is freed 2 times by the cache"):
        alloc.free([2, 2], cached=True)
    alloc.free([2])
    with pytest.raises(ValueError, match="page 2 is held by the cache alone: free it with cached=True"):
        alloc.free([2])
    assert state(alloc)[1][2] == 1 and alloc.num_evictable == 1  # the refused calls changed nothing


@pytest.mark.parametrize("call", list(CALLS))
def test_every_allocator_call_is_all_or_nothing(call):
    run = CALLS[call]
    before = state(fresh())
    done = fresh()
    run(done)
    after = state(done)
    tracer, lines = interrupt_at(-1, 0)
    sys.settrace(tracer)
    try:
        run(fresh())
    finally:
        sys.settrace(None)
    assert lines
    for line, count in sorted(lines.items()):
        for hit in range(1, count + 1):
            alloc = fresh()
            tracer, _ = interrupt_at(line, hit)
            sys.settrace(tracer)
            try:
                result, raised = run(alloc), False
            except KeyboardInterrupt:
                result, raised = None, True
            finally:
                sys.settrace(None)
            where = f"{call} interrupted at paging.py:{line} (hit {hit})"
            assert state(alloc) == (before if raised else after), where  # an exception changes nothing
            if call == "allocate" and not raised:
                assert result == [4, 5, 6], where


def test_counts_and_sizes_are_ints_not_bools():
    with pytest.raises(ValueError, match="positive int, got True"):
        PageAllocator(True)
    with pytest.raises(ValueError, match="non-negative page count, got True"):
        PageAllocator(4).allocate(True)
    with pytest.raises(ValueError, match=r"page id in \[0, 4\), got False"):
        PageAllocator(4).free([False])
    with pytest.raises(ValueError, match="page_size to be a positive int, got True"):
        to_page_table(torch.zeros(1, 4, dtype=torch.int32), True)


def test_a_page_table_knows_its_page_size():
    rows = torch.tensor([[28, 29, 30, 31, 8, 9, 0, 0]], dtype=torch.int32)
    table = to_page_table(rows, 4)
    assert isinstance(table, PageTable) and isinstance(table, torch.Tensor) and table.page_size == 4
    assert table.tolist() == [[7, 2]] and torch.equal(table, torch.tensor([[7, 2]], dtype=torch.int32))
    assert type(table[0]) is torch.Tensor and type(table + 1) is torch.Tensor  # results are plain tensors
    raw = torch.tensor([[7, 2]], dtype=torch.int32)
    wrapped = PageTable(raw, 4)
    assert wrapped.data_ptr() == raw.data_ptr() and wrapped.page_size == 4
    with pytest.raises(ValueError, match="expected table to be an int32 tensor of shape"):
        PageTable(raw.long(), 4)
    with pytest.raises(ValueError, match="expected page_size to be a positive int, got 0"):
        PageTable(raw, 0)
