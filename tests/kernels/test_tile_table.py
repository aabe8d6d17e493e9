"""The per-device tile table (``kernels/triton/tile_table.py``): entries override the rules' tiles for
their problem class on their device model only, the key the sweep writes under is the key the launcher
looks up, paged launches only, bad entries are named, and a sweep's timings update one device's entries
(winners by more than ``MIN_GAIN``, entries dropped where the rules win)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import BACKENDS

pytestmark = pytest.mark.skipif("triton" not in BACKENDS, reason="triton not available here")

if "triton" in BACKENDS:
    from portattn.kernels.triton import launch, tile_table
    from portattn.kernels.triton.launch import TileConfig, choose_tiles

ENTRY = {"block_m": 16, "block_n": 32, "num_warps": 4, "num_stages": 2, "pages_ahead": True}


@pytest.fixture
def table(tmp_path, monkeypatch):
    """A table file of the test's own (``write(dict)``), in place of the package's."""
    path = tmp_path / "tile_table.json"
    monkeypatch.setattr(tile_table, "TABLE", path)
    tile_table._load.cache_clear()

    def write(content: dict) -> None:
        tile_table.write(path, content)
        launch.choose_tiles.cache_clear()  # its choices are cached per problem

    yield write
    tile_table._load.cache_clear()
    launch.choose_tiles.cache_clear()


def decode_rules(**kw) -> TileConfig:
    return choose_tiles(1, 4, 128, 128, interpret=False, kv_itemsize=2, **kw)


def test_entries_override_their_class_on_their_device(table):
    key = tile_table.rule_key(decode_rules(), 4, 128, 128, 2, 2)
    assert key == "m16 n64 w8 s5 g4 d128/128 kv2 q2"
    table({"Test GPU": {key: ENTRY}})
    assert decode_rules(device_name="Test GPU") == TileConfig(4, 16, 32, 4, 2, pages_ahead=True)
    assert decode_rules(device_name="Other GPU") == decode_rules()  # another model: the rules
    run = choose_tiles(512, 4, 128, 128, interpret=False, kv_itemsize=2, device_name="Test GPU")
    assert run == choose_tiles(512, 4, 128, 128, interpret=False, kv_itemsize=2)  # another class
    many = decode_rules(decode_waves=4.0, device_name="Test GPU")
    assert (many.block_n, many.num_warps, many.num_stages) == (64, 4, 3)  # its key is m16 n64 w4 s3 ...


def test_the_sweep_key_is_the_launch_key(table, monkeypatch):
    """What ``tile_class`` gives a launch (the sweep's key) is what ``choose_tiles`` looks up for it."""
    monkeypatch.setattr(launch, "is_triton_interpreter", lambda: False)
    monkeypatch.setattr(launch, "device_model", lambda device: "Test GPU")
    q = torch.zeros(64, 32, 128, dtype=torch.float16)
    k = v = torch.zeros(256, 16, 8, 128, dtype=torch.float16)
    args = (q, k, v, 64, 1, 1024, 1)
    rules = launch.default_tiles(*args)
    table({"Test GPU": {launch.tile_class(q, k, v, launch.default_tiles(*args, swept=False, fit=False)): ENTRY}})
    assert launch.default_tiles(*args) == TileConfig(4, 16, 32, 4, 2, pages_ahead=True)
    assert launch.default_tiles(*args, paged=False) == rules  # contiguous launches keep the rules
    assert launch.default_tiles(*args, swept=False) == rules


def test_bad_entries_are_named(table):
    key = tile_table.rule_key(decode_rules(), 4, 128, 128, 2, 2)
    table({"Test GPU": {key: {"block_n": 32}}})
    with pytest.raises(ValueError, match=r"Test GPU.*block_m"):
        decode_rules(device_name="Test GPU")
    table({"Test GPU": {tile_table.rule_key(choose_tiles(1, 8, 128, 128, interpret=False, kv_itemsize=2), 8, 128,
                                           128, 2, 2): ENTRY | {"block_m": 4}}})  # fmt: skip
    with pytest.raises(ValueError, match="block_m >= 8"):
        choose_tiles(1, 8, 128, 128, interpret=False, kv_itemsize=2, device_name="Test GPU")


def test_a_sweep_updates_one_device():
    rules = {"block_m": 16, "block_n": 64, "num_warps": 8, "num_stages": 5, "pages_ahead": False}
    faster = ENTRY
    slightly = ENTRY | {"num_stages": 3}
    old = {"Other GPU": {"a": rules}, "Test GPU": {"stale": faster, "b": slightly}}
    timings = [
        ("a", rules, 1.00, [(faster, 0.90), (slightly, 0.95)]),  # 11% faster: set
        ("b", rules, 1.00, [(slightly, 0.99)]),  # 1%: the rules stay (the entry is dropped)
        ("stale", rules, 1.00, [(rules, 0.90)]),  # the rules' own tiles won: dropped
        ("c", rules, 1.00, [(slightly, 0.96), (faster, 0.90)]),  # two cases of class c: summed,
        ("c", rules, 1.00, [(slightly, 0.96), (faster, 1.04)]),  # slightly wins (1.92 against 1.94)
        ("d", rules, 1.00, [(faster, 0.80)]),  # one case of class d gains 25%,
        ("d", rules, 0.50, [(faster, 0.60)]),  # another loses 20%: 1.40 against 1.50 still gains 7%
        ("e", rules, 1.00, [(faster, 0.80)]),  # class e's second case did not time this candidate:
        ("e", rules, 1.00, [(slightly, 1.10)]),  # nothing timed in both beats the rules
        ("f", rules, 1.00, [(faster, 0.80)]),  # one case gains 20%,
        ("f", rules, 0.20, [(faster, 0.45)]),  # another takes twice as long: 1.25 against 1.20, dropped
    ]
    new = tile_table.updated(old, "Test GPU", timings)
    assert new["Other GPU"] == old["Other GPU"]
    assert new["Test GPU"] == {"a": faster, "c": slightly, "d": faster}
    assert tile_table.updated(old, "Test GPU", [("stale", rules, 1.0, []), ("b", rules, 1.0, [])]) == {
        "Other GPU": old["Other GPU"]
    }


def test_write_tiles_from_bench_results(table, tmp_path, capsys):
    from portattn.bench.__main__ import main, write_tiles

    rules = {"block_m": 16, "block_n": 64, "num_warps": 8, "num_stages": 5, "pages_ahead": False}
    results = [
        {"case": "decode", "sweep_table": {"key": "k1", "rule": rules, "rule_ms": 1.0, "candidates": [[ENTRY, 0.5]]}},
        {"case": "no sweep"},
        {"case": "failed rules", "sweep_table": {"key": "k2", "rule": rules, "candidates": [[ENTRY, 0.5]]}},
    ]
    path = tmp_path / "out.json"
    write_tiles(path, "Test GPU", results)
    assert json.loads(path.read_text()) == {"Test GPU": {"k1": ENTRY}}
    assert "tile table Test GPU [k1]: rules ->" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--write-tiles"])  # the table comes from a sweep
    assert "add --sweep --graph" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--sweep", "--write-tiles"])  # timed as graph replays
    assert "add --sweep --graph" in capsys.readouterr().err


def test_the_package_table_loads():
    table = tile_table.load()
    assert isinstance(table, dict)
    for entries in table.values():
        for entry in entries.values():
            TileConfig(1, entry["block_m"], entry["block_n"], entry["num_warps"], entry["num_stages"])
