"""Where the 16-head Gluon MLA kernel over e4m3 (``mla_decode_fp8_mma``) goes wrong (round 33's GPU tests: output
errors of 3 to 4 with the warpgroup-MMA scores). Sequences of one key have probabilities of exactly 1, so their output
is the key's latent row whatever the scores: 512 one-key sequences whose rows are one-hot (sequence ``b`` holds
1.0 at dim ``b``) show where each dim lands in the output (the values' product and the store), and their LSE
(``scale * q[dim b]``) which query dim the scores paired with it. Then a random case of lengths 1, 2, 17, 64, 65,
300 against the float64 reference (round 34's log: the first version, whose random case used a small latent and
stopped). Run on a GPU from the repository root with PYTHONPATH=src:tests."""

import torch

from ops.test_mla import make_mla_case
from portattn.kernels.triton import mla_decode_fp8_mma as k8
from portattn.kernels.triton.launch import f16_query_scale
from portattn.kv_quant import dequantize_kv
from portattn.testing import mla_decode_ref

H, SCALE, LOG2E = 16, 0.07, 1.4426950408889634


def one_hot_case():
    batch = 512
    kv = torch.zeros(batch, 64, 576)
    for b in range(batch):
        kv[b, 0, b] = 1.0
    page_table = torch.arange(batch, dtype=torch.int32)[:, None].cuda()
    seq_lens = torch.ones(batch, dtype=torch.int32).cuda()
    q_nope = (torch.arange(512).float() / 4 - 64).expand(batch, H, 512)  # distinct by dim
    q_nope = q_nope + torch.arange(H).float()[None, :, None] / 64  # distinct by head
    q_rope = torch.zeros(batch, H, 64)
    return q_nope.bfloat16().cuda(), q_rope.bfloat16().cuda(), kv.to(torch.float8_e4m3fn).cuda(), page_table, seq_lens


def decode(qn, qr, kv, pt, sl, out, lse, wgmma):
    """The kernel launched directly (``MLATileConfig`` refuses ``wgmma_scores=True`` since round 34)."""
    q_scale = f16_query_scale(SCALE)
    k8.launch(qn, qr, kv, pt, sl, out, lse, out, lse, q_scale=q_scale, qk_scale_log2=SCALE / q_scale * LOG2E,
              kv_scale=1.0, num_kv_splits=1, write_partial=False, write_lse=True, min_split=1, block_n=64, stages=2,
              wgmma=wgmma)  # fmt: skip


for wgmma in (False, True):
    print(f"== wgmma scores {wgmma}")
    print("   supports:", k8.supports(*one_hot_case()[:3], torch.empty(1, 1, 512, device="cuda"), wgmma=wgmma))
    qn, qr, kv, pt, sl = one_hot_case()
    out = torch.full_like(qn, float("nan"))
    lse = torch.full(qn.shape[:2], float("nan"), device="cuda")
    decode(qn, qr, kv, pt, sl, out, lse, wgmma)
    torch.cuda.synchronize()
    o = out.float().cpu()
    landed = o[:, 0].abs().argmax(-1)  # head 0: where dim b landed
    wrong = [(b, int(landed[b])) for b in range(512) if int(landed[b]) != b]
    print(f"   values: {512 - len(wrong)} of 512 dims land on themselves; first wrong (dim, landed): {wrong[:16]}")
    print(f"   head 0 row sums (should be 1): {o[:8, 0].sum(-1).tolist()}")
    print(f"   heads equal: {bool((o[:, 1:] == o[:, :1]).all())}; nan: {int(o.isnan().sum())}")
    expect = (qn.float() * SCALE)[torch.arange(512), :, torch.arange(512)].cpu()  # [b, h]
    got = lse.cpu()
    # which query dim each sequence's LSE matched (head 0)
    qd = qn[0, 0].float().cpu() * SCALE
    matched = [int((qd - got[b, 0]).abs().argmin()) for b in range(512)]
    bad = [(b, matched[b], float(got[b, 0]), float(expect[b, 0])) for b in range(512) if matched[b] != b]
    print(f"   scores: {512 - len(bad)} of 512 LSEs pair dim b with query dim b; first wrong: {bad[:8]}")
    print(f"   max |lse - expected| {float((got - expect).abs().max()):.3e}")
    # random case against the reference
    case = make_mla_case(
        [1, 2, 17, 64, 65, 300], page_size=16, num_heads=H, rank=512, rope_dim=64, device="cuda", seed=1
    )
    kvq = case.kv_cache.to(torch.float8_e4m3fn)
    qn, qr = case.q_nope.bfloat16(), case.q_rope.bfloat16()
    ref, ref_lse = mla_decode_ref(qn, qr, dequantize_kv(kvq, 1.0, torch.float64), case.page_table, case.seq_lens,
                                  scale=SCALE, return_lse=True)  # fmt: skip
    out = torch.full_like(qn, float("nan"))
    lse = torch.full(qn.shape[:2], float("nan"), device="cuda")
    decode(qn, qr, kvq, case.page_table, case.seq_lens, out, lse, wgmma)
    oe = (out.double() - ref).abs().amax(dim=(1, 2)).tolist()
    le = (lse.double() - ref_lse).abs().amax(dim=1).tolist()
    print("   random: out err by seq", " ".join(f"{x:.1e}" for x in oe), "; lse err", " ".join(f"{x:.1e}" for x in le))
