"""``python -m portattn.bench.mla`` with the seesaw kernel's one row maximum a pair
(``mla_decode_seesaw_fp8.PAIR_MAX``) or without: ``python3 bench_pair.py on|off ARGS...``."""

import sys

from portattn.bench import mla
from portattn.kernels.triton import mla_decode_seesaw_fp8

mla_decode_seesaw_fp8.PAIR_MAX = sys.argv[1] == "on"
sys.exit(mla.main(sys.argv[2:]))
