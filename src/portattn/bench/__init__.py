"""Benchmarks: ``python -m portattn.bench`` (paged decode/extend/prefill, varlen encoder).

One module per op (``paged_attention``, ``varlen_attention``), one timing helper (``timing``),
the ceilings measured in the same run (``ceilings``), work formulas with masks accounted
(``work``), the peers on the same data (``peers``), and the report (``report``).
"""
