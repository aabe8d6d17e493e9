"""``python -m portattn.bench.mla`` with the twin kernel (``mla_decode_wide_fp8.TWIN``) or the seesaw kernel:
``python3 bench_twin.py on|off ARGS...``."""

import sys

from portattn.bench import mla
from portattn.kernels.triton import mla_decode_wide_fp8

mla_decode_wide_fp8.TWIN = sys.argv[1] == "on"
sys.exit(mla.main(sys.argv[2:]))
