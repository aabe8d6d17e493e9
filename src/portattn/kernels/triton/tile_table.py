"""Per-device tiles of the attention kernel, filled by the op benchmark's sweep.

``launch.choose_tiles`` picks tiles by rules measured on one GPU (an H200). A device model whose sweep
found faster tiles for a problem has them here: ``tile_table.json`` maps a device name (as
``torch.cuda.get_device_name`` gives it) and the rules' choice for a problem (:func:`rule_key`) to
the tiles that device runs instead. A problem without an entry keeps the rules' tiles, so a device that
was never swept runs as before. ``python -m portattn.bench --sweep --write-tiles`` writes the entries
of the device it runs on (:func:`updated`): the fastest tiles at the launch's own split count where
they beat the rules' by more than :data:`MIN_GAIN` over every swept case of the class, and drops the
entries whose rules now win.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

TABLE = Path(__file__).with_name("tile_table.json")
MIN_GAIN = 0.03  # a sweep's winner must beat the rules' tiles by this fraction (timing noise is ~1%)
FIELDS = ("block_m", "block_n", "num_warps", "num_stages", "pages_ahead")


def rule_key(tiles, group_pad: int, head_dim: int, value_dim: int, kv_itemsize: int, itemsize: int) -> str:
    """The problem class of a launch: the rules' tiles for it with the sizes they were chosen for
    (``m128 n128 w8 s3 ahead g4 d128/128 kv2 q2``: query heads a KV head rounded up to a power of two,
    head dims, the K/V and query element sizes)."""
    ahead = " ahead" if tiles.pages_ahead else ""
    return (
        f"m{tiles.block_m} n{tiles.block_n} w{tiles.num_warps} s{tiles.num_stages}{ahead} "
        f"g{group_pad} d{head_dim}/{value_dim} kv{kv_itemsize} q{itemsize}"
    )


def entry_of(tiles) -> dict:
    """A table entry: the fields of a ``TileConfig`` that the table sets."""
    return {name: getattr(tiles, name) for name in FIELDS}


@functools.cache
def _load(path: str) -> dict:
    file = Path(path)
    table = json.loads(file.read_text()) if file.exists() else {}
    if not isinstance(table, dict):
        raise ValueError(f"expected {file} to hold a JSON object of device names, got {type(table).__name__}")
    for device, entries in table.items():
        for key, entry in entries.items():
            if not isinstance(entry, dict) or set(entry) != set(FIELDS):
                raise ValueError(
                    f"expected {file} [{device!r}][{key!r}] to hold the fields {list(FIELDS)}, got {entry}"
                )
    return table


def load(path: Path | None = None) -> dict:
    """The whole table: ``{device name: {problem class: entry}}`` (checked)."""
    return _load(str(path or TABLE))


def entries(device_name: str | None, path: Path | None = None) -> dict:
    """``device_name``'s entries by problem class (:func:`rule_key`); empty for a device never swept."""
    if device_name is None:
        return {}
    return _load(str(path or TABLE)).get(device_name, {})


def updated(table: dict, device_name: str, timings: list[tuple[str, dict, float, list[tuple[dict, float]]]]) -> dict:
    """``table`` with ``device_name``'s entries set from a sweep: for each ``(key, rule entry, rule ms,
    [(entry, ms), ...])`` (the candidates at the launch's own split count), the fastest candidate where
    it beats the rules' tiles by more than :data:`MIN_GAIN`; the entry dropped where it does not. The
    cases of one key are one problem class, which takes one entry: a candidate is judged by its time
    summed over every case of the key (one it was not timed in does not count), against the rules'
    summed likewise, so an entry that speeds up one case of a class cannot slow down another."""
    device = dict(table.get(device_name, {}))
    cases: dict[str, list[tuple[dict, float, list[tuple[dict, float]]]]] = {}
    for key, rule, rule_ms, candidates in timings:
        cases.setdefault(key, []).append((rule, rule_ms, candidates))
    for key, runs in cases.items():
        rule_total = sum(rule_ms for _, rule_ms, _ in runs)
        totals: dict[str, list] = {}  # candidate (as JSON) -> [entry, summed ms, cases timed]
        for rule, _, candidates in runs:
            seen = set()
            for entry, ms in candidates:
                name = json.dumps(entry, sort_keys=True)
                if entry == rule or name in seen:  # the rules' own tiles, or a second timing in one case
                    continue
                seen.add(name)
                total = totals.setdefault(name, [entry, 0.0, 0])
                total[1] += ms
                total[2] += 1
        complete = [(ms, entry) for entry, ms, n in totals.values() if n == len(runs) and ms > 0]
        best_ms, winner = min(complete, key=lambda c: c[0], default=(rule_total, None))
        if winner is not None and rule_total / best_ms - 1 > MIN_GAIN:
            device[key] = winner
        else:
            device.pop(key, None)
    out = {name: entries for name, entries in table.items() if name != device_name}
    if device:
        out[device_name] = dict(sorted(device.items()))
    return out


def write(path: Path, table: dict) -> None:
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    _load.cache_clear()
