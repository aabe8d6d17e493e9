"""``scripts/mla_times.py``: a case's settings parsed, applied to the kernel modules and set back, bad settings
refused with what was expected (its timings need a GPU and run there)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")  # mla_decode_wide_fp8's Gluon

from portattn.kernels.triton import mla_decode_launch, mla_decode_wide_fp8

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "mla_times.py"


@pytest.fixture(scope="module")
def mla_times():
    spec = importlib.util.spec_from_file_location("mla_times", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_case_is_its_settings_then_the_arguments(mla_times):
    line = "mla_decode_wide_fp8.SEESAW_VREGS=True mla_decode_wide_fp8.RING=4 e4m3 --heads 64 --splits=2"
    settings, words = mla_times.parse_case(line)
    assert settings == [("mla_decode_wide_fp8", "SEESAW_VREGS", True), ("mla_decode_wide_fp8", "RING", 4)]
    assert words == ["e4m3", "--heads", "64", "--splits=2"]  # an option's '=' is not a setting
    assert mla_times.parse_case("bf16 --heads 17") == ([], ["bf16", "--heads", "17"])
    wanted = re.escape("expected a setting module.NAME=value, got SEESAW=True")
    with pytest.raises(ValueError, match=wanted):
        mla_times.parse_case("SEESAW=True e4m3")
    wanted = re.escape("expected a Python literal for mla_decode_wide_fp8.RING, got 'four'")
    with pytest.raises(ValueError, match=wanted):
        mla_times.parse_case("mla_decode_wide_fp8.RING=four e4m3")


def test_settings_hold_inside_the_case_and_every_switch_is_set_back(mla_times):
    before = (mla_decode_wide_fp8.SEESAW_VREGS, mla_decode_wide_fp8.SEESAW, mla_decode_launch.WIDE)
    with mla_times.applied([("mla_decode_wide_fp8", "SEESAW_VREGS", not before[0])]):
        assert mla_decode_wide_fp8.SEESAW_VREGS is (not before[0])
        mla_decode_wide_fp8.SEESAW = not before[1]  # as ncu_mla.py's --seesaw sets it
        mla_decode_launch.WIDE = not before[2]
    after = (mla_decode_wide_fp8.SEESAW_VREGS, mla_decode_wide_fp8.SEESAW, mla_decode_launch.WIDE)
    assert after == before


def test_an_unknown_setting_is_refused_before_any_is_set(mla_times):
    ring = mla_decode_wide_fp8.RING
    wanted = re.escape("expected an attribute of portattn.kernels.triton.mla_decode_wide_fp8, got NO")
    settings = [("mla_decode_wide_fp8", "RING", ring + 1), ("mla_decode_wide_fp8", "NO", 1)]
    with pytest.raises(ValueError, match=wanted), mla_times.applied(settings):
        pass
    assert ring == mla_decode_wide_fp8.RING
    with pytest.raises(ModuleNotFoundError), mla_times.applied([("no_such_kernel", "X", 1)]):
        pass
