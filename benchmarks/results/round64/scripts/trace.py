"""clock64 stamps of the seesaw kernel's partitions (``trace.patch`` applied): ``python3 trace.py OUT_DIR [NAME...]``
(the cases named, default all).

Each case makes ``ncu_mla.py``'s four launches with ``mla_decode_seesaw_fp8.TRACE`` set; the last launch's stamps of
two programs (sequences 0 and 32, split 0) are saved as ``OUT_DIR/trace_NAME.pt`` ([2 programs, 3 partitions (left,
right, producer), 64 pairs or tiles, 16 events]; ``analyse_trace.py`` reads them)."""

import sys

import torch

sys.path.insert(0, "scripts")
import ncu_mla

from portattn.kernels.triton import mla_decode_seesaw_fp8 as seesaw

OUT_DIR, NAMES = sys.argv[1], sys.argv[2:]
BASE = ["e4m3", "--fp8-scores", "--fp8-values", "--seesaw"]
CASES = {
    "trans_h64_s2": (True, ["--heads", "64"]),
    "round63_h64_s2": (False, ["--heads", "64"]),
    "trans_h64_s1": (True, ["--heads", "64", "--splits", "1"]),
    "trans_h64_s2_resident": (True, ["--heads", "64", "--resident"]),
}
for name, (trans_load, words) in CASES.items():
    if NAMES and name not in NAMES:
        continue
    seesaw.TRANS_LOAD = trans_load
    seesaw.TRACE = torch.zeros(2, 3, 64, 16, dtype=torch.int64, device="cuda")
    sys.argv = ["ncu_mla.py", *BASE, *words]
    ncu_mla.main()
    torch.cuda.synchronize()
    torch.save(seesaw.TRACE.cpu(), f"{OUT_DIR}/trace_{name}.pt")
    print(name, "saved", flush=True)
seesaw.TRACE = None
seesaw.TRANS_LOAD = True
