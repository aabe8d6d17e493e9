"""Page tables and the page allocator: exact equality, since this code only moves integers."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from portattn import OutOfPagesError, PageAllocator, to_page_table


def _allocate_rows(rng: random.Random, lens: list[int], page_size: int, width: int, num_pages: int):
    """Page-aligned req_to_token rows over a random permutation of pages, junk past each length."""
    free = list(range(num_pages))
    rng.shuffle(free)
    table = torch.full((len(lens), width), -7, dtype=torch.int32)
    pages = []
    for b, n in enumerate(lens):
        row_pages = [free.pop() for _ in range(-(-n // page_size))]
        pages.append(row_pages)
        for i in range(n):
            table[b, i] = row_pages[i // page_size] * page_size + i % page_size
        for i in range(n, width):
            table[b, i] = rng.randrange(-5, num_pages * page_size + 5)
    return table, pages


@settings(max_examples=60, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 3, 7, 16, 64]),
    lens=st.lists(st.integers(0, 150), min_size=1, max_size=5),
    seed=st.integers(0, 2**16),
)
def test_to_page_table_round_trips_page_aligned_allocations(page_size, lens, seed):
    rng = random.Random(seed)
    width = max(max(lens), 1) + rng.randrange(0, 2 * page_size)
    num_pages = sum(-(-n // page_size) for n in lens) + 3
    table, pages = _allocate_rows(rng, lens, page_size, width, num_pages)
    seq_lens = torch.tensor(lens, dtype=torch.int32)

    page_table = to_page_table(table, page_size, seq_lens=seq_lens, check=True)

    assert page_table.dtype == torch.int32
    assert page_table.shape == (len(lens), -(-width // page_size))
    for b, row_pages in enumerate(pages):
        assert page_table[b, : len(row_pages)].tolist() == row_pages


def test_to_page_table_worked_example():
    # page_size 4; one request of 6 tokens in physical pages 7 and 2.
    row = torch.tensor([[28, 29, 30, 31, 8, 9, 0, 0]], dtype=torch.int32)
    assert to_page_table(row, 4, seq_lens=torch.tensor([6]), check=True).tolist() == [[7, 2]]


def test_to_page_table_accepts_int64_rows():
    row = torch.tensor([[6, 7, 8, 0]], dtype=torch.int64)
    assert to_page_table(row, 2).tolist() == [[3, 4]]


@pytest.mark.parametrize(
    ("row", "seq_len", "where"),
    [
        ([28, 29, 31, 30, 8, 9], 6, "row 1, column 2"),  # out of order inside a page
        ([28, 29, 30, 31, 8, 10], 6, "row 1, column 5"),  # skips a slot
        ([29, 30, 31, 32, 8, 9], 6, "row 1, column 0"),  # page not aligned to a page start
        ([28, 29, 30, 31, 9, 10], 6, "row 1, column 4"),
    ],
)
def test_to_page_table_check_names_row_and_column(row, seq_len, where):
    good = [0, 1, 2, 3, 4, 5]
    table = torch.tensor([good, row], dtype=torch.int32)
    with pytest.raises(ValueError, match=f"not page-aligned at {where}"):
        to_page_table(table, 4, seq_lens=torch.tensor([6, seq_len]), check=True)


def test_to_page_table_check_ignores_columns_past_seq_len():
    table = torch.tensor([[28, 29, 30, 31, 8, 9, 123, -1]], dtype=torch.int32)
    to_page_table(table, 4, seq_lens=torch.tensor([6]), check=True)
    with pytest.raises(ValueError, match="row 0, column 6"):
        to_page_table(table, 4, check=True)


@pytest.mark.parametrize(
    ("table", "page_size", "kwargs", "message"),
    [
        (torch.zeros(4, dtype=torch.int32), 2, {}, "expected token_table of shape"),
        (torch.zeros(2, 4, dtype=torch.float32), 2, {}, "expected token_table of dtype int32 or int64"),
        (torch.zeros(2, 4, dtype=torch.int32), 0, {}, "expected page_size to be a positive int"),
        (torch.zeros(2, 4, dtype=torch.int32), 2, {"seq_lens": torch.tensor([1]), "check": True}, "seq_lens of shape"),
        (torch.zeros(1, 4, dtype=torch.int32), 2, {"seq_lens": torch.tensor([5]), "check": True}, "exceed"),
    ],
)
def test_to_page_table_rejects_bad_input(table, page_size, kwargs, message):
    with pytest.raises(ValueError, match=message):
        to_page_table(table, page_size, **kwargs)


def test_allocator_allocates_distinct_pages_and_returns_them():
    alloc = PageAllocator(5)
    a = alloc.allocate(3)
    assert len(set(a)) == 3 and alloc.num_free == 2 and alloc.num_used == 3
    assert alloc.can_allocate(2) and not alloc.can_allocate(3)
    alloc.free(a)
    assert alloc.num_free == 5 and alloc.num_used == 0


def test_allocator_exhaustion_is_a_clear_error():
    alloc = PageAllocator(2)
    alloc.allocate(2)
    with pytest.raises(OutOfPagesError, match="cannot allocate 1 pages: 0 of 2 are free"):
        alloc.allocate(1)
    assert alloc.num_free == 0


def test_allocator_double_free_and_bad_ids():
    alloc = PageAllocator(3)
    pages = alloc.allocate(1)
    alloc.free(pages)
    with pytest.raises(ValueError, match=f"double free of page {pages[0]}"):
        alloc.free(pages)
    held = alloc.allocate(1)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(held + held)  # freeing one holder twice in one call
    assert alloc.ref_count(held[0]) == 1  # the failed call changed nothing
    with pytest.raises(ValueError, match=r"page id in \[0, 3\), got 3"):
        alloc.free([3])
    with pytest.raises(ValueError, match="positive int"):
        PageAllocator(0)
    with pytest.raises(ValueError, match="non-negative page count"):
        alloc.allocate(-1)


def test_allocator_reference_counts_share_pages():
    alloc = PageAllocator(4)
    pages = alloc.allocate(2)
    alloc.retain(pages)
    alloc.free(pages)
    assert alloc.num_free == 2 and all(alloc.ref_count(p) == 1 for p in pages)
    alloc.free(pages)
    assert alloc.num_free == 4
    with pytest.raises(ValueError, match="cannot retain free page"):
        alloc.retain(pages[:1])


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["alloc", "free", "retain"]), st.integers(0, 6)), max_size=40))
def test_allocator_counts_stay_consistent(ops):
    alloc = PageAllocator(10)
    holders: dict[int, int] = {}  # the model: page -> holder count
    for op, n in ops:
        if op == "alloc":
            if n > 10 - len(holders):
                with pytest.raises(OutOfPagesError):
                    alloc.allocate(n)
                continue
            for page in alloc.allocate(n):
                assert page not in holders
                holders[page] = 1
        elif holders:
            page = sorted(holders)[n % len(holders)]
            if op == "retain":
                alloc.retain([page])
                holders[page] += 1
            else:
                alloc.free([page])
                holders[page] -= 1
                if holders[page] == 0:
                    del holders[page]
        assert alloc.num_used == len(holders)
        assert alloc.num_free + alloc.num_used == alloc.num_pages
        assert all(alloc.ref_count(p) == c for p, c in holders.items())
