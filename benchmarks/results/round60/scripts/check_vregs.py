"""The fp8-values GPU test's seesaw forms with the value products read from registers
(``mla_decode_wide_fp8.SEESAW_VREGS``), in process: ``python3 check_vregs.py [pytest -k expression]``."""

import sys

import pytest

from portattn.kernels.triton import mla_decode_wide_fp8

mla_decode_wide_fp8.SEESAW_VREGS = True
expr = sys.argv[1] if len(sys.argv) > 1 else "fp8_values"
sys.exit(pytest.main(["-q", "-s", "-p", "no:cacheprovider", "tests/kernels/test_mla_wide_fp8.py", "-k", expr]))
