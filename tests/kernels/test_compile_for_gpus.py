"""The sampler's, the fused linears', the rotary and argmax Triton kernels, the attention kernel with whole pages
a tile and the MLA decode over an fp8 cache with its latent rows loaded twice compile for a Hopper GPU (sm_90,
to a cubin through ptxas) on any machine: the CPU's interpreter runs Python, not the compiler, so a construct
the compiler refuses (types a loop carries, branches on runtime values, a global that is not a constexpr)
would otherwise surface only on a GPU.

The compile runs in a child process without ``TRITON_INTERPRET`` (under the interpreter,
``@triton.jit`` makes functions the compiler cannot take)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SKIP = 3  # the child's exit status when this triton cannot compile for CUDA here

CHILD = textwrap.dedent(
    """
    import sys
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as exc:
        print("no compiler:", exc); sys.exit(3)
    from portattn.kernels.triton.gumbel_max import gumbel_max_kernel
    from portattn.kernels.triton.nucleus import nucleus_kernel
    from portattn.kernels.triton.fused_linear import merge_linear_kernel, norm_linear_kernel, norm_linear_rotary_kernel
    from portattn.kernels.triton.fused_linear import row_linear_kernel, row_linear_rotary_kernel, expert_rows_kernel
    from portattn.kernels.triton.fused_linear import expert_tokens_kernel
    from portattn.kernels.triton.fp8_quant import quantize_rows_kernel
    from portattn.kernels.triton.grouped_topk import grouped_topk_kernel
    from portattn.kernels.triton.router_topk import router_topk_kernel
    from portattn.kernels.triton.kv_write import kv_write_kernel
    from portattn.kernels.triton.attn_temperature import attn_temperature_kernel
    from portattn.kernels.triton.merge import merge_splits_kernel
    from portattn.kernels.triton.argmax import argmax_chunks_kernel, argmax_merge_kernel
    from portattn.kernels.triton.fused_rotary import rotary_table_kernel
    from portattn.kernels.triton.fused_rotary import latent_rotary_write_kernel, rotary_kv_write_kernel
    from portattn.kernels.triton.fused_rotary import rotary_pairs_kernel
    from portattn.kernels.triton.attention import attention_fwd_kernel

    COMMON = {"vocab": "i32", "stride_row": "i32", "num_rows": "i32"}
    ROTARY = {**{name: "*bf16" for name in ("Q", "K", "V", "Cos", "Sin", "QOut", "KCache", "VCache")},
              "Slots": "*i64", "T": "i32",
              **{name: "i32" for name in ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh",
                                          "stride_cos", "stride_sin", "stride_ot", "stride_oh", "stride_ks",
                                          "stride_kch", "stride_vs", "stride_vch")}}
    NUCLEUS = {"Scores": "*fp32", "Temperature": "*fp32", "TopP": "*fp32", "TopK": "*i64", "Floor": "*fp32",
               "RowWords": "*i64", "Greedy": "*i1", "Out": "*i64", **COMMON}
    KERNELS = [
        ("nucleus, raw logits", nucleus_kernel, NUCLEUS,
         {"DIVIDE": True, "ROUNDS": 32, "BLOCK": 4096, "HAS_TOP_K": False, "HAS_FLOOR": False}, 8),
        ("nucleus, scaled scores", nucleus_kernel, NUCLEUS,
         {"DIVIDE": False, "ROUNDS": 32, "BLOCK": 4096, "HAS_TOP_K": False, "HAS_FLOOR": False}, 8),
        ("nucleus, top_k searched", nucleus_kernel, NUCLEUS,
         {"DIVIDE": True, "ROUNDS": 32, "BLOCK": 4096, "HAS_TOP_K": True, "HAS_FLOOR": False}, 8),
        ("nucleus, top_k floors and search", nucleus_kernel, NUCLEUS,
         {"DIVIDE": True, "ROUNDS": 32, "BLOCK": 4096, "HAS_TOP_K": True, "HAS_FLOOR": True}, 8),
        ("gumbel_max", gumbel_max_kernel,
         {"Scores": "*fp32", "Temperature": "*fp32", "RowWords": "*i64", "Greedy": "*i1", "BestScore": "*fp32",
          "BestToken": "*i32", **COMMON, "num_chunks": "i32"}, {"DIVIDE": True, "BLOCK": 1024, "CHUNK": 4096}, 4),
    ]
    LINEAR = {**{name: "*bf16" for name in ("X", "Residual", "NormWeight", "W", "Bias", "Out", "ResidualOut")},
              "WScale": "*fp32", "M": "i32", "N": "i32", "K": "i32", "eps": "fp32",
              **{name: "i32" for name in ("stride_x", "stride_r", "stride_ro", "stride_w", "stride_o")}}
    FLAGS = {"HAS_NORM": True, "HAS_RESIDUAL": True, "MODE": 0, "HAS_BIAS": True, "ACT": 0, "BLOCK_M": 16,
             "BLOCK_N": 16, "INTERLEAVED": False, "W_SCALED": False, "PDL": False}
    ROW = {**{name: "*bf16" for name in ("X", "Residual", "NormWeight", "W", "Bias", "Out", "ResidualOut")},
           "WScale": "*fp32", "N": "i32", "K": "i32", "eps": "fp32", "stride_w": "i32", "word_step": "i32"}
    BYTES = {"W_WORDS": False, "ASM": False}  # row_linear's weight tiles as Triton reads them
    KERNELS += [
        ("norm_linear, one step", norm_linear_kernel, LINEAR,
         {**FLAGS, "GATED": False, "BLOCK_K": 1024, "SINGLE": True}, 4),
        ("norm_linear, gated, steps", norm_linear_kernel, LINEAR,
         {**FLAGS, "GATED": True, "BLOCK_K": 256, "SINGLE": False}, 4),
        ("norm_linear, one step, PDL", norm_linear_kernel, LINEAR,
         {**FLAGS, "GATED": False, "BLOCK_K": 1024, "SINGLE": True, "PDL": True}, 4),
        ("linear, 2048 features in one step, PDL", norm_linear_kernel, LINEAR,
         {**FLAGS, "HAS_NORM": False, "HAS_RESIDUAL": False, "GATED": False, "BLOCK_K": 2048, "SINGLE": True,
          "PDL": True}, 8),
        ("row_linear, norm and gated activation, PDL", row_linear_kernel,
         ROW,
         {"HAS_NORM": True, "HAS_RESIDUAL": True, "MODE": 0, "HAS_BIAS": False, "GATED": True, "ACT": 0,
          "BLOCK_N": 8, "BLOCK_K": 1024, "ROW": 4096, "INTERLEAVED": False, "W_SCALED": False, "PDL": True,
          **BYTES}, 4),
        ("row_linear, plain", row_linear_kernel,
         ROW,
         {"HAS_NORM": False, "HAS_RESIDUAL": False, "MODE": 0, "HAS_BIAS": False, "GATED": False, "ACT": 0,
          "BLOCK_N": 8, "BLOCK_K": 1024, "ROW": 16, "INTERLEAVED": False, "W_SCALED": False, "PDL": False,
          **BYTES}, 4),
        ("row_linear, fp8 weights, norm and gated activation, PDL", row_linear_kernel, {**ROW, "W": "*fp8e4nv"},
         {"HAS_NORM": True, "HAS_RESIDUAL": True, "MODE": 0, "HAS_BIAS": False, "GATED": True, "ACT": 0,
          "BLOCK_N": 8, "BLOCK_K": 1024, "ROW": 4096, "INTERLEAVED": True, "W_SCALED": True, "PDL": True,
          **BYTES}, 4),
        ("row_linear, fp8 weights as words (inline PTX), norm, PDL", row_linear_kernel, {**ROW, "W": "*fp8e4nv"},
         {"HAS_NORM": True, "HAS_RESIDUAL": True, "MODE": 0, "HAS_BIAS": False, "GATED": False, "ACT": 0,
          "BLOCK_N": 16, "BLOCK_K": 1024, "ROW": 4096, "INTERLEAVED": False, "W_SCALED": True, "PDL": True,
          "W_WORDS": True, "ASM": True}, 4),
        ("row_linear, fp8 weights as words, gate and up rows alternating, PDL", row_linear_kernel,
         {**ROW, "W": "*fp8e4nv"},
         {"HAS_NORM": True, "HAS_RESIDUAL": True, "MODE": 0, "HAS_BIAS": False, "GATED": True, "ACT": 0,
          "BLOCK_N": 8, "BLOCK_K": 1024, "ROW": 4096, "INTERLEAVED": True, "W_SCALED": True, "PDL": True,
          "W_WORDS": True, "ASM": True}, 4),
        ("row_linear, fp8 weights as words, [gate; up] halves", row_linear_kernel, {**ROW, "W": "*fp8e4nv"},
         {"HAS_NORM": False, "HAS_RESIDUAL": False, "MODE": 0, "HAS_BIAS": True, "GATED": True, "ACT": 0,
          "BLOCK_N": 8, "BLOCK_K": 1024, "ROW": 16, "INTERLEAVED": False, "W_SCALED": True, "PDL": False,
          "W_WORDS": True, "ASM": True}, 4),
        ("norm_linear, fp8 weights, gated, steps", norm_linear_kernel, {**LINEAR, "W": "*fp8e4nv"},
         {**FLAGS, "GATED": True, "BLOCK_K": 256, "SINGLE": False, "W_SCALED": True}, 4),
        ("quantize_rows to fp8, PDL", quantize_rows_kernel,
         {"X": "*bf16", "Out": "*fp8e4nv", "Scale": "*fp32", "cols": "i32", "stride_x": "i32", "stride_out": "i32"},
         {"FP8_MAX": 448.0, "MIN_SCALE": 1e-12, "BLOCK": 1024, "PDL": True}, 4),
        ("row_linear_rotary, PDL", row_linear_rotary_kernel,
         {**{name: "*bf16" for name in ("X", "Residual", "NormWeight", "W", "Bias", "Cos", "Sin", "QOut", "KCache",
                                        "VCache", "ResidualOut")},
          "Slots": "*i64", "K": "i32", "eps": "fp32",
          **{name: "i32" for name in ("stride_w", "stride_ks", "stride_kh", "stride_vs", "stride_vh")}},
         {"HAS_NORM": True, "HAS_RESIDUAL": True, "MODE": 0, "HAS_BIAS": False, "NUM_Q_HEADS": 32, "NUM_KV_HEADS": 8,
          "HEAD_DIM": 128, "BLOCK_N": 8, "BLOCK_K": 1024, "ROW": 4096, "PDL": True}, 4),
        ("row_linear, alternating gate and up rows, PDL", row_linear_kernel,
         ROW,
         {"HAS_NORM": True, "HAS_RESIDUAL": True, "MODE": 0, "HAS_BIAS": False, "GATED": True, "ACT": 0,
          "BLOCK_N": 4, "BLOCK_K": 1024, "ROW": 4096, "INTERLEAVED": True, "W_SCALED": False, "PDL": True,
          **BYTES}, 4),
        ("expert_rows, gated, PDL", expert_rows_kernel,
         {"X": "*bf16", "Ids": "*i64", "Scale": "*bf16", "W": "*bf16", "Out": "*bf16", "N": "i32", "K": "i32",
          "stride_x": "i32", "stride_e": "i64", "stride_w": "i32", "stride_o": "i32", "num_experts": "i32"},
         {"GATED": True, "ACT": 0, "INTERLEAVED": False, "TOP_K": 1, "HAS_SCALE": False, "HAS_IDS": True, "BLOCK_N": 8,
          "BLOCK_K": 1024, "PDL": True, "SCALE_INPUT": False}, 4),
        ("expert_rows, a token's 8 experts combined, PDL", expert_rows_kernel,
         {"X": "*bf16", "Ids": "*i64", "Scale": "*fp32", "W": "*bf16", "Out": "*bf16", "N": "i32", "K": "i32",
          "stride_x": "i32", "stride_e": "i64", "stride_w": "i32", "stride_o": "i32", "num_experts": "i32"},
         {"GATED": False, "ACT": 0, "INTERLEAVED": False, "TOP_K": 8, "HAS_SCALE": True, "HAS_IDS": True, "BLOCK_N": 8,
          "BLOCK_K": 1024, "PDL": True, "SCALE_INPUT": False}, 4),
        ("expert_rows, a head's weight a row (MLA's value product), PDL", expert_rows_kernel,
         {"X": "*bf16", "Ids": "*bf16", "Scale": "*bf16", "W": "*bf16", "Out": "*bf16", "N": "i32", "K": "i32",
          "stride_x": "i32", "stride_e": "i64", "stride_w": "i32", "stride_o": "i32", "num_experts": "i32"},
         {"GATED": False, "ACT": 0, "INTERLEAVED": False, "TOP_K": 1, "HAS_SCALE": False, "HAS_IDS": False,
          "BLOCK_N": 8, "BLOCK_K": 1024, "PDL": True, "SCALE_INPUT": False}, 4),
        ("latent_rotary_write with the latent norm, DeepSeek V3's interleaved rope, PDL", latent_rotary_write_kernel,
         {"QPe": "*bf16", "CKv": "*bf16", "KPe": "*bf16", "Cos": "*bf16", "Sin": "*bf16", "Slots": "*i64",
          "QOut": "*bf16", "Latent": "*bf16", "NormWeight": "*bf16", "eps": "fp32",
          **{name: "i32" for name in ("stride_qt", "stride_qh", "stride_ct", "stride_kt", "stride_cos", "stride_sin",
                                      "stride_ot", "stride_oh", "stride_row")}},
         {"NUM_HEADS": 128, "RANK": 512, "BLOCK_R": 512, "HALF": 32, "BLOCK": 32, "INTERLEAVE": True, "NORM": True,
          "PDL": True}, 1),
        ("rotary_pairs with the q/k norm, PDL", rotary_pairs_kernel,
         {"Q": "*bf16", "K": "*bf16", "Freqs": "*fp32", "QOut": "*bf16", "KOut": "*bf16", "eps": "fp32",
          **{name: "i32" for name in ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_f", "stride_qot",
                                      "stride_qoh", "stride_kot", "stride_koh")}},
         {"NUM_Q_HEADS": 40, "HALF": 64, "BLOCK": 64, "NORM": True, "PDL": True}, 1),
        ("grouped_topk, DeepSeek V3's 256 experts, PDL", grouped_topk_kernel,
         {"Logits": "*fp32", "Bias": "*fp32", "Weights": "*fp32", "Ids": "*i64", "stride_l": "i32",
          "scaling": "fp32"},
         {"NUM_EXPERTS": 256, "NUM_GROUPS": 8, "GROUPS": 8, "PER_GROUP": 32, "TOPK_GROUP": 4, "TOP_K": 8,
          "SLOTS": 8, "NORMALIZE": True, "PDL": True}, 4),
        ("router_topk, Llama 4 Scout's 16 experts, PDL", router_topk_kernel,
         {"X": "*bf16", "W": "*bf16", "Partials": "*fp32", "Counters": "*i32", "Scores": "*bf16", "Ids": "*i64",
          "K": "i32", "stride_x": "i32", "stride_w": "i32"},
         {"NUM_EXPERTS": 16, "BLOCK_E": 16, "BLOCK_K": 256, "SPLIT_K": 512, "NUM_SPLITS": 10, "BLOCK_S": 16,
          "TOP_K": 1, "SLOTS": 1, "PDL": True}, 4),
        ("kv_write, PDL", kv_write_kernel,
         {"K": "*bf16", "V": "*bf16", "Slots": "*i64", "KCache": "*bf16", "VCache": "*bf16",
          **{name: "i32" for name in ("stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_kc_slot",
                                      "stride_kc_h", "stride_vc_slot", "stride_vc_h")}},
         {"HEAD_DIM": 128, "VALUE_DIM": 128, "BLOCK_D": 128, "BLOCK_V": 128, "PDL": True}, 1),
        ("attn_temperature, libdevice, PDL", attn_temperature_kernel,
         {"Q": "*bf16", "Positions": "*i64", "Out": "*bf16", "attn_scale": "fp32", "floor_scale": "fp32",
          "stride_q": "i32", "stride_o": "i32"},
         {"WIDTH": 5120, "BLOCK": 1024, "LIBDEVICE": True, "PDL": True}, 4),
        ("expert_rows, gated, scaled input (Llama 4), PDL", expert_rows_kernel,
         {"X": "*bf16", "Ids": "*i64", "Scale": "*bf16", "W": "*bf16", "Out": "*bf16", "N": "i32", "K": "i32",
          "stride_x": "i32", "stride_e": "i64", "stride_w": "i32", "stride_o": "i32", "num_experts": "i32"},
         {"GATED": True, "ACT": 0, "INTERLEAVED": True, "TOP_K": 1, "HAS_SCALE": True, "HAS_IDS": True, "BLOCK_N": 4,
          "BLOCK_K": 1024, "PDL": True, "SCALE_INPUT": True}, 4),
        ("expert_tokens, gated, scaled input, PDL", expert_tokens_kernel,
         {"X": "*bf16", "Ids": "*i64", "Scale": "*fp32", "W": "*bf16", "Out": "*bf16", "T": "i32", "N": "i32",
          "K": "i32", "stride_xt": "i32", "stride_xs": "i32", "stride_e": "i64", "stride_w": "i32", "stride_o": "i32"},
         {"TOP_K": 8, "SLOTS": 8, "GATED": True, "ACT": 0, "INTERLEAVED": True, "SCALE_INPUT": True,
          "SCALE_OUTPUT": False, "DOT_PRECISION": None, "BLOCK_T": 32, "BLOCK_N": 64, "BLOCK_K": 64, "PDL": True}, 4),
        ("merge_linear, PDL", merge_linear_kernel,
         {"PartialOut": "*fp32", "PartialLse": "*fp32", "W": "*bf16", "Out": "*bf16", "N": "i32", "num_heads": "i32",
          "num_splits": "i32", "stride_w": "i32", "stride_o": "i32"},
         {"HEADS_PAD": 16, "SPLITS_PAD": 8, "VALUE_DIM": 64, "BLOCK_DV": 64, "BLOCK_N": 8, "PDL": True}, 4),
        ("norm_linear_rotary, one step, PDL", norm_linear_rotary_kernel,
         {**{name: "*bf16" for name in ("X", "Residual", "NormWeight", "W", "Bias", "Cos", "Sin", "QOut", "KCache",
                                        "VCache", "ResidualOut")},
          "Slots": "*i64", "M": "i32", "K": "i32", "eps": "fp32",
          **{name: "i32" for name in ("stride_x", "stride_r", "stride_ro", "stride_w", "stride_cos", "stride_sin",
                                      "stride_qt", "stride_ks", "stride_kh", "stride_vs", "stride_vh")}},
         {"HAS_NORM": True, "HAS_RESIDUAL": True, "MODE": 0, "HAS_BIAS": True, "NUM_Q_HEADS": 9, "NUM_KV_HEADS": 3,
          "HEAD_DIM": 64, "BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 1024, "SINGLE": True, "PDL": True}, 4),
        ("rotary_kv_write, PDL", rotary_kv_write_kernel, ROTARY,
         {"NUM_Q_HEADS": 9, "NUM_KV_HEADS": 3, "HALF": 32, "BLOCK": 32, "VALUE_DIM": 64, "BLOCK_V": 64,
          "BLOCK_T": 1, "BLOCK_H": 1, "PDL": True}, 1),
        ("rotary_kv_write, blocks of tokens and heads", rotary_kv_write_kernel, ROTARY,
         {"NUM_Q_HEADS": 32, "NUM_KV_HEADS": 8, "HALF": 64, "BLOCK": 64, "VALUE_DIM": 128, "BLOCK_V": 128,
          "BLOCK_T": 4, "BLOCK_H": 8, "PDL": False}, 4),
        ("merge_splits, PDL", merge_splits_kernel,
         {"PartialOut": "*fp32", "PartialLse": "*fp32", "Sinks": "*bf16", "Out": "*bf16", "Lse": "*fp32",
          "num_heads": "i32", "num_splits": "i32", "stride_ot": "i32", "stride_oh": "i32", "stride_lt": "i32",
          "stride_lh": "i32"},
         {"SPLITS_PAD": 4, "BLOCK_DV": 128, "VALUE_DIM": 128, "HAS_SINKS": False, "HAS_LSE": False, "PDL": True}, 4),
        ("rotary_table, libdevice, PDL", rotary_table_kernel,
         {"Positions": "*i64", "InvFreq": "*fp32", "Cos": "*bf16", "Sin": "*bf16", "T": "i32", "scaling": "fp32",
          "stride_pos": "i32", "stride_cos": "i32", "stride_sin": "i32"},
         {"HALF": 32, "BLOCK_T": 16, "BLOCK": 32, "LIBDEVICE": True, "PDL": True}, 4),
        ("argmax chunks with the copy, PDL", argmax_chunks_kernel,
         {"Scores": "*fp32", "Copy": "*fp32", "BestScore": "*fp32", "BestToken": "*i32", "V": "i32",
          "stride_s": "i32", "stride_c": "i32", "num_chunks": "i32"},
         {"CHUNK": 4096, "COPY": True, "PDL": True}, 8),
        ("argmax merge, PDL", argmax_merge_kernel,
         {"BestScore": "*fp32", "BestToken": "*i32", "Out": "*i64", "num_chunks": "i32"},
         {"BLOCK_C": 16, "PDL": True}, 1),
    ]
    ATTENTION = {**{name: "*bf16" for name in ("Q", "K", "V", "Out", "Sinks", "AlibiSlopes")},
                 **{name: "*fp32" for name in ("Lse", "PartialOut", "PartialLse")},
                 **{name: "*i32" for name in ("PageTable", "CuSeqlensQ", "SeqLensK", "KvStart", "MergeCounters")},
                 "num_seqs": "i32", **{name: "fp32" for name in ("q_scale", "qk_scale", "v_scale", "softcap")},
                 **{name: "i32" for name in ("window_left", "window_right", "chunk_size", "stride_qt", "stride_qh",
                                             "stride_kp", "stride_ks", "stride_kh", "stride_vp", "stride_vs",
                                             "stride_vh", "stride_vd", "stride_ot", "stride_oh", "stride_lt",
                                             "stride_lh", "stride_pt", "stride_wt", "stride_wh", "stride_ws")}}
    FLAGS = {name: False for name in ("CAUSAL", "HAS_WINDOW_LEFT", "HAS_WINDOW_RIGHT", "HAS_CHUNK", "HAS_SINKS",
                                      "HAS_SOFTCAP", "HAS_ALIBI", "HAS_LSE", "SPLIT", "F16_DOTS", "MERGE_IN_KERNEL",
                                      "V_KEYS")}
    KERNELS += [
        ("attention, whole pages a tile, PDL", attention_fwd_kernel, ATTENTION,
         {**FLAGS, "GROUP": 4, "GROUP_PAD": 4, "BLOCK_Q": 4, "BLOCK_M": 16, "BLOCK_N": 32, "HEAD_DIM": 64,
          "BLOCK_D": 64, "BLOCK_D2": 0, "BLOCK_D3": 0, "VALUE_DIM": 64, "BLOCK_DV": 64, "BLOCK_DV2": 0,
          "BLOCK_DV3": 0, "PARTIAL_DV": 64, "PAGE_SIZE": 16, "PAGED": True, "CAUSAL": True, "DOT_PRECISION": None,
          "ROW_ALIGN": 8, "PAGES_AHEAD": True, "PDL": True, "WHOLE_PAGES": True}, 4),
        ("attention, fp8 decode over keys-contiguous V, whole pages, 128 registers, PDL", attention_fwd_kernel,
         {**ATTENTION, "K": "*fp8e4nv", "V": "*fp8e4nv"},
         {**FLAGS, "GROUP": 4, "GROUP_PAD": 4, "BLOCK_Q": 4, "BLOCK_M": 16, "BLOCK_N": 128, "HEAD_DIM": 128,
          "BLOCK_D": 128, "BLOCK_D2": 0, "BLOCK_D3": 0, "VALUE_DIM": 128, "BLOCK_DV": 128, "BLOCK_DV2": 0,
          "BLOCK_DV3": 0, "PARTIAL_DV": 128, "PAGE_SIZE": 16, "PAGED": True, "CAUSAL": True, "DOT_PRECISION": None,
          "ROW_ALIGN": 16, "SPLIT": True, "F16_DOTS": True, "PAGES_AHEAD": True, "PDL": True, "WHOLE_PAGES": True,
          "V_KEYS": True}, {"num_warps": 4, "num_stages": 2, "maxnreg": 128}),
    ]
    from portattn.kernels.triton.mla_decode import mla_decode_split_kernel

    MLA = {"QNope": "*bf16", "QRope": "*bf16", "KV": "*fp8e4nv", "PageTable": "*i32", "SeqLensK": "*i32",
           "Out": "*bf16", **{name: "*fp32" for name in ("Lse", "PartOut", "PartLse")},
           **{name: "fp32" for name in ("q_scale", "qk_scale_log2", "kv_scale")},
           **{name: "i32" for name in ("num_heads", "num_kv_splits", "stride_qn_b", "stride_qn_h", "stride_qn_d",
                                       "stride_qr_b", "stride_qr_h", "stride_qr_d", "stride_kv_page",
                                       "stride_kv_slot", "stride_kv_d", "stride_pt_b", "stride_pt_p", "stride_o_b",
                                       "stride_o_h", "stride_o_d", "stride_lse_b", "stride_lse_h")}}
    KERNELS += [  # the default tiles of 16 heads over an fp8 latent cache: the rows loaded again for the values
        ("MLA decode over fp8, the latent rows loaded again", mla_decode_split_kernel, MLA,
         {"KV_LORA_RANK": 512, "ROPE_DIM": 64, "PAGE_SIZE": 64, "BLOCK_H": 16, "BLOCK_N": 32, "BLOCK_R": 512,
          "BLOCK_RP": 64, "WRITE_PARTIAL": True, "WRITE_LSE": False, "DOT_PRECISION": None, "F16_DOTS": True,
          "MIN_SPLIT": 64, "SEPARATE_VALUES": True, "DEQUANTIZE_ONCE": False}, 4),
    ]
    for name, fn, signature, constexprs, warps in KERNELS:
        signature = {**signature, **{key: "constexpr" for key in constexprs}}
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        try:
            options = warps if isinstance(warps, dict) else {"num_warps": warps}
            kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        except (FileNotFoundError, RuntimeError) as exc:
            if "ptxas" in str(exc):
                print("no ptxas:", exc); sys.exit(3)
            raise
        # programmatic dependent launch: the wait (and the trigger) in the PTX exactly where asked for
        pdl = "griddepcontrol.wait" in kernel.asm["ptx"] and "griddepcontrol.launch_dependents" in kernel.asm["ptx"]
        print(name, "cubin", len(kernel.asm["cubin"]), "pdl" if pdl else "-")
    """
)


def test_the_sampler_and_linear_kernels_compile_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(src), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    if done.returncode == SKIP:
        pytest.skip(done.stdout.strip())
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    names = [line.split(" cubin ")[0] for line in lines]
    assert names == [
        "nucleus, raw logits",
        "nucleus, scaled scores",
        "nucleus, top_k searched",
        "nucleus, top_k floors and search",
        "gumbel_max",
        "norm_linear, one step",
        "norm_linear, gated, steps",
        "norm_linear, one step, PDL",
        "linear, 2048 features in one step, PDL",
        "row_linear, norm and gated activation, PDL",
        "row_linear, plain",
        "row_linear, fp8 weights, norm and gated activation, PDL",
        "row_linear, fp8 weights as words (inline PTX), norm, PDL",
        "row_linear, fp8 weights as words, gate and up rows alternating, PDL",
        "row_linear, fp8 weights as words, [gate; up] halves",
        "norm_linear, fp8 weights, gated, steps",
        "quantize_rows to fp8, PDL",
        "row_linear_rotary, PDL",
        "row_linear, alternating gate and up rows, PDL",
        "expert_rows, gated, PDL",
        "expert_rows, a token's 8 experts combined, PDL",
        "expert_rows, a head's weight a row (MLA's value product), PDL",
        "latent_rotary_write with the latent norm, DeepSeek V3's interleaved rope, PDL",
        "rotary_pairs with the q/k norm, PDL",
        "grouped_topk, DeepSeek V3's 256 experts, PDL",
        "router_topk, Llama 4 Scout's 16 experts, PDL",
        "kv_write, PDL",
        "attn_temperature, libdevice, PDL",
        "expert_rows, gated, scaled input (Llama 4), PDL",
        "expert_tokens, gated, scaled input, PDL",
        "merge_linear, PDL",
        "norm_linear_rotary, one step, PDL",
        "rotary_kv_write, PDL",
        "rotary_kv_write, blocks of tokens and heads",
        "merge_splits, PDL",
        "rotary_table, libdevice, PDL",
        "argmax chunks with the copy, PDL",
        "argmax merge, PDL",
        "attention, whole pages a tile, PDL",
        "attention, fp8 decode over keys-contiguous V, whole pages, 128 registers, PDL",
        "MLA decode over fp8, the latent rows loaded again",
    ]
    assert all(int(line.split(" cubin ")[1].split()[0]) > 0 for line in lines)
    assert [line.endswith(" pdl") for line in lines] == [name.endswith("PDL") for name in names]
