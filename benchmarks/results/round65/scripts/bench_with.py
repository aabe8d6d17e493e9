"""``python -m portattn.bench.mla`` with settings of ``mla_decode_seesaw_fp8`` changed:
``python3 bench_with.py NAME=value [NAME=value ...] -- BENCH_ARGUMENTS``."""

import ast
import sys

from portattn.bench import mla
from portattn.kernels.triton import mla_decode_seesaw_fp8 as seesaw

split = sys.argv.index("--")
for item in sys.argv[1:split]:
    name, _, text = item.partition("=")
    if not hasattr(seesaw, name):
        raise SystemExit(f"expected a setting of mla_decode_seesaw_fp8, got {name}")
    setattr(seesaw, name, ast.literal_eval(text))
    print(f"mla_decode_seesaw_fp8.{name} = {getattr(seesaw, name)!r}")
sys.exit(mla.main(sys.argv[split + 1 :]))
