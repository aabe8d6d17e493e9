"""``python -m portattn.bench.mla`` with the seesaw kernel's value products read from registers
(``mla_decode_wide_fp8.SEESAW_VREGS``) or not: ``python3 bench_vregs.py on|off ARGS...``."""

import sys

from portattn.bench import mla
from portattn.kernels.triton import mla_decode_wide_fp8

mla_decode_wide_fp8.SEESAW_VREGS = sys.argv[1] == "on"
sys.exit(mla.main(sys.argv[2:]))
