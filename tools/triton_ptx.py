"""Compile Triton kernels of the backend to PTX for sm_90a without a GPU, and print one digest per kernel: the
check that a refactor leaves a kernel's generated code unchanged (run before and after; equal digests, equal
code). The digest covers the PTX with its debug lines (`.loc`, `.file`, `//` comments) left out, so moving code
between files or lines does not change it.

    python tools/triton_ptx.py              # every kernel in CASES
    python tools/triton_ptx.py sample gg_   # the cases whose name contains one of the words

Triton compiles through its bundled ptxas for the target given here; nothing is launched. The signatures are
those the wrappers launch with at flash shapes (bf16 logits, FP8 activations and weights), with the JIT's
specialisation of such a launch (`_sig`) and its launch options (`OPTIONS`). `tools/triton_sass.py` reads the same
cases' registers, spills and loop SASS.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret (read when triton is imported)
# no line info: LLVM orders some instructions by their debug locations, so a kernel moved down a file would
# otherwise lower to reordered (equivalent) PTX
os.environ["TRITON_DISABLE_LINE_INFO"] = "1"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from deepinfer_kernels.triton import attention, gemm, mhc, moe_grouped, moe_prefill, norm, quant, sampling  # noqa: E402
from deepinfer_kernels.triton import compressor, rope, speculative  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def _sig(fn, types: dict, consts: dict, odd: tuple = ()) -> ASTSource:
    """The kernel as a launch at flash shapes compiles it. Triton's JIT specialises each launch on its arguments:
    an integer equal to 1 becomes the constant 1 (give it in `consts`), one divisible by 16 and a 16-byte-aligned
    pointer are marked so (tt.divisibility 16), which lets loads vectorise and changes register allocation. Every
    pointer and integer here is marked but those in `odd` (not multiples of 16 at the flash launch). Compiled
    without the marks, a kernel can look nothing like what runs (the prefill FP4 GEMM: 852 B of spill and 1300
    SASS a step without, none and 352 with)."""
    names = fn.arg_names
    # constexpr parameters with a default the wrapper does not pass (e.g. TOPK = 1) compile at that default
    consts = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **consts}
    sig = {n: ("constexpr" if n in consts else types[n]) for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n not in odd and (sig[n].startswith("*") or sig[n] in ("i32", "i64"))}
    return ASTSource(fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)


def _ints(*names):
    return dict.fromkeys(names, "i32")


_GG_FP4_TYPES = {
    "a_ptr": "*bf16", "as_ptr": "*fp32", "w_ptr": "*u8", "ws_ptr": "*u8", "c_ptr": "*bf16", "p_ptr": "*fp32",
    "cnt_ptr": "*i32", "rows_ptr": "*i64", "bexp_ptr": "*i64",
    **_ints("P", "E", "N", "K", "KS_A", "KS_W", "KB_PER_SPLIT", "SA_R")}
_GG_FP4_CONSTS = {"BM": 128, "BN": 64, "SPLIT": False, "DOT_BF16": True, "SCALE_E8M0": True, "ASM": True,
                  "IDENT": False, "EVEN": True, "FOLD": False, "A_BF16": True, "N_FAST": True}

_FP8_DECODE_TYPES = {
    "a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "c_ptr": "*bf16", "p_ptr": "*fp32",
    "cnt_ptr": "*i32", **_ints("M", "N", "K", "KS_A", "KS_W", "KB_PER_SPLIT")}
_FP8_DECODE_CONSTS = {"BM": 16, "BN": 64, "BK": 128, "GROUP_M": 1, "SPLIT": True, "M": 1}  # batch 1

_FP8_TMA_TYPES = {"a_desc": "tensordesc<fp8e4nv[64, 128]>", "as_ptr": "*fp32", "w_desc": "tensordesc<fp8e4nv[128, 128]>",
                  "ws_ptr": "*fp32", "c_ptr": "*bf16", **_ints("M", "N", "K", "KS_A", "KS_W")}
_FP8_TMA_CONSTS = {"BM": 64, "BN": 128, "GROUP_M": 16}

_ATTN_TYPES = {
    "q_ptr": "*bf16", "kv_ptr": "*u8", "kvr_ptr": "*bf16", "sink_ptr": "*fp32", "idx_ptr": "*i64", "o_ptr": "*bf16",
    "ml_ptr": "*fp32", "acc_ptr": "*fp32", "scale": "fp32", "qc_ptr": "*fp32", "qs_ptr": "*fp32", "q_eps": "fp32",
    **_ints("S", "H", "N", "D", "KSEL", "CHUNK", "W", "WE", "ROFF", "NOPE", "QCS", "QSS", "QR0", "QHALF")}
_ATTN_CONSTS = {"BH": 16, "BK": 32, "BD": 512, "IEEE": False, "SPLIT": True, "PACKED": True, "S": 1}  # batch 1

_MIX_TYPES = {"x_ptr": "*bf16", "fn_ptr": "*fp32", "ws_ptr": "*fp32", "sub_ptr": "*bf16", "res_ptr": "*bf16",
              "post_ptr": "*fp32", "comb_ptr": "*fp32", "sh_ptr": "*bf16",
              **_ints("R", "KD", "KCH", "NS", "HC", "D", "K", "RT", "RK", "ST")}
_MIX_CONSTS = {"BR": 32, "BK": 256}

_NR_TYPES = {"x_ptr": "*bf16", "w_ptr": "*fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "y_ptr": "*bf16",
             "eps": "fp32", "cache_ptr": "*bf16", "cacher_ptr": "*bf16", "rows_ptr": "*i64", "slots_ptr": "*i64",
             **_ints("N", "XS", "H", "CS", "SS", "HALF", "s_c0", "s_c1", "ES", "ROFF", "NOPE", "NB")}
_NR_CONSTS = {"HAS_W": True, "BLOCK": 512, "BR": 32}

_CP_TYPES = {"kv_ptr": "*fp32", "sc_ptr": "*fp32", "ape_ptr": "*fp32", "rows_ptr": "*i64", "skv_ptr": "*fp32",
             "ssc_ptr": "*fp32", "y_ptr": "*bf16",
             **_ints("n", "part", "L", "r", "D", "C2", "SLOTS_ST", "KV_BS", "KV_SS", "SC_BS", "SC_SS", "OFF")}
_CP_ODD = ("n", "part", "L", "r", "SLOTS_ST", "OFF")  # a prompt's window count and phase, the ratio's slot counts

CASES = {
    "sample": lambda: _sig(sampling._sample_kernel, {
        "l_ptr": "*bf16", "temp_ptr": "*fp32", "topk_ptr": "*i64", "topp_ptr": "*fp32", "seed_ptr": "*i64",
        "pos_ptr": "*i64", "ws_ptr": "*i64", "out_ptr": "*i64", **_ints("V")},
        {"BLOCK": 2048, "HBLOCK": 128, "CB": sampling.CAND}),
    "spec_probs": lambda: _sig(speculative._spec_probs_kernel, {
        "l_ptr": "*bf16", "temp_ptr": "*fp32", "topk_ptr": "*i64", "topp_ptr": "*fp32", "out_ptr": "*fp32",
        **_ints("V")}, {"BLOCK": 2048}),
    "gg_fp8": lambda: _sig(moe_grouped._gg_fp8_kernel, {
        "a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "c_ptr": "*bf16",
        "rows_ptr": "*i32", "bexp_ptr": "*i32", **_ints("P", "N", "K", "KS_A", "NS_W", "KS_W", "E")},
        {"BM": 64, "BN": 128, "BK": 128}),
    "gg_float": lambda: _sig(moe_grouped._gg_float_kernel, {
        "a_ptr": "*bf16", "w_ptr": "*bf16", "c_ptr": "*bf16", "rows_ptr": "*i32", "bexp_ptr": "*i32",
        **_ints("P", "N", "K")}, {"BM": 64, "BN": 64, "BK": 64, "IEEE": False}),
    "gg_fp8_tma": lambda: _sig(moe_prefill._gg_fp8_tma_kernel, {
        "a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "w_desc": "tensordesc<fp8e4nv[128, 128]>", "ws_ptr": "*fp32",
        "c_ptr": "*bf16", "rows_ptr": "*i32", "bexp_ptr": "*i32", **_ints("P", "N", "K", "KS_A", "KS_W", "NS_W")},
        {"BM": 64, "BN": 128}),
    # the prefill FP4 expert GEMM as the model calls it (A converted, N tiles fastest, raw ue8m0 scales)
    "gg_fp4": lambda: _sig(moe_grouped._gg_fp4_kernel, _GG_FP4_TYPES, _GG_FP4_CONSTS),
    # the same and the FP8 kernels reading one A row per token for its 6 pairs (grouped_gemm topk)
    "gg_fp4_topk": lambda: _sig(moe_grouped._gg_fp4_kernel, _GG_FP4_TYPES, {**_GG_FP4_CONSTS, "TOPK": 6}),
    "gg_fp4_one_dot": lambda: _sig(moe_grouped._gg_fp4_kernel, _GG_FP4_TYPES,
                                   {**_GG_FP4_CONSTS, "FOLD": True, "ONE_DOT": True}),
    "gg_fp8_topk": lambda: _sig(moe_grouped._gg_fp8_kernel, {
        "a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "c_ptr": "*bf16",
        "rows_ptr": "*i64", "bexp_ptr": "*i64", **_ints("P", "N", "K", "KS_A", "NS_W", "KS_W", "E")},
        {"BM": 16, "BN": 128, "BK": 128, "TOPK": 6}),
    "gg_fp8_ident": lambda: _sig(moe_grouped._gg_fp8_kernel, {
        "a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "c_ptr": "*bf16",
        "rows_ptr": "*i64", "bexp_ptr": "*i64", **_ints("P", "N", "K", "KS_A", "NS_W", "KS_W", "E")},
        {"BM": 16, "BN": 128, "BK": 128, "IDENT": True}, odd=("P",)),  # batch 1: a token's 6 pairs
    "gg_fp8_tma_topk": lambda: _sig(moe_prefill._gg_fp8_tma_kernel, {
        "a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "w_desc": "tensordesc<fp8e4nv[128, 128]>", "ws_ptr": "*fp32",
        "c_ptr": "*bf16", "rows_ptr": "*i64", "bexp_ptr": "*i64", **_ints("P", "N", "K", "KS_A", "KS_W", "NS_W")},
        {"BM": 128, "BN": 128, "TOPK": 6}),
    # the routed w2 at batch 1 computing its A (SwiGLU + act_quant) from w1|w3's bf16 output (swiglu_grouped_gemm)
    "gg_fp4_swiglu": lambda: _sig(moe_grouped._gg_fp4_kernel, {**_GG_FP4_TYPES, "as_ptr": "*fp32", "rows_ptr": "*i64"},
                                  {**_GG_FP4_CONSTS, "BM": 16, "BN": 128, "SPLIT": True, "IDENT": True, "A_BF16": False,
                                   "N_FAST": False, "A_SWIGLU": True, "LIMIT": 10.0, "WEIGHT": True},
                                  odd=("P", "KB_PER_SPLIT")),  # batch 1: a token's 6 pairs, 8 K blocks a split
    "gg_fp8_swiglu": lambda: _sig(moe_grouped._gg_fp8_kernel, {
        "a_ptr": "*bf16", "as_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "c_ptr": "*bf16",
        "rows_ptr": "*i64", "bexp_ptr": "*i64", **_ints("P", "N", "K", "KS_A", "NS_W", "KS_W", "E")},
        {"BM": 16, "BN": 128, "BK": 128, "IDENT": True, "A_SWIGLU": True, "LIMIT": 10.0, "WEIGHT": True},
        odd=("P",)),  # batch 1: a token's 6 pairs
    # the prefill FP8 GEMM (TMA operands, TMA_TILES): exact products summed in fp32 (the default), on f16 wgmma
    # (DEEPINFER_FP8_GEMM=exact-wgmma) and promoted per 128-K block (=triton)
    "fp8_gemm_tma": lambda: _sig(gemm._fp8_gemm_tma_kernel, _FP8_TMA_TYPES, {**_FP8_TMA_CONSTS, "EXACT": True}),
    "fp8_gemm_tma_f16": lambda: _sig(gemm._fp8_gemm_tma_kernel, _FP8_TMA_TYPES,
                                     {**_FP8_TMA_CONSTS, "EXACT": False, "F16": True}),
    "fp8_gemm_tma_per128": lambda: _sig(gemm._fp8_gemm_tma_kernel, _FP8_TMA_TYPES, {**_FP8_TMA_CONSTS, "EXACT": False}),
    # the decode FP8 GEMM (split-K), and with A act_quant'ed as it is loaded (act_quant_fp8_gemm: wo_b)
    "fp8_gemm_decode": lambda: _sig(gemm._fp8_gemm_kernel, _FP8_DECODE_TYPES, _FP8_DECODE_CONSTS,
                                    odd=("KB_PER_SPLIT",)),  # 3 or 7 K blocks a split at flash shapes
    "act_quant_fp8_gemm": lambda: _sig(gemm._fp8_gemm_kernel, {**_FP8_DECODE_TYPES, "a_ptr": "*bf16",
                                                               "as_ptr": "*bf16"},
                                       {**_FP8_DECODE_CONSTS, "QUANT_A": True}, odd=("KB_PER_SPLIT",)),
    # decode's sparse attention over the FP8 KV layout (latency tiles, split slots), and with the q head norm and
    # RoPE in its q load (q_norm_sparse_attn_fp8)
    "attn_fp8_decode": lambda: _sig(attention._sparse_attn_kernel, _ATTN_TYPES, _ATTN_CONSTS),
    "attn_fp8_q_norm": lambda: _sig(attention._sparse_attn_kernel, _ATTN_TYPES, {**_ATTN_CONSTS, "QNORM": 1}),
    # the mHC mix at decode (hc 4, D 4096: 256-column splits), and with the previous sub-layer's post-mix in it
    # (hc_post_pre_quant); the post-mix launches themselves
    "hc_mix": lambda: _sig(mhc._hc_mix_kernel, _MIX_TYPES, _MIX_CONSTS),
    "hc_mix_post": lambda: _sig(mhc._hc_mix_kernel, _MIX_TYPES, {**_MIX_CONSTS, "POST": 1, "BHC": 4}),
    "hc_mix_moe_post": lambda: _sig(mhc._hc_mix_kernel, _MIX_TYPES, {**_MIX_CONSTS, "POST": 2, "BHC": 4}),
    "hc_post": lambda: _sig(mhc._hc_post_kernel, {
        "x_ptr": "*bf16", "res_ptr": "*bf16", "post_ptr": "*fp32", "comb_ptr": "*fp32", "y_ptr": "*bf16",
        **_ints("HC", "D")}, {"BHC": 4, "BD": 128}),
    "moe_combine_post": lambda: _sig(mhc._moe_combine_post_kernel, {
        "r_ptr": "*bf16", "s_ptr": "*bf16", "res_ptr": "*bf16", "post_ptr": "*fp32", "comb_ptr": "*fp32",
        "y_ptr": "*bf16", **_ints("HC", "D", "K", "RT", "RK", "ST")}, {"BHC": 4, "BD": 128}),
    # the kv norm with its RoPE, and with its entry packed into the FP8-layout cache (rms_norm_rope_store)
    "rms_norm_rope": lambda: _sig(norm._rms_norm_rope_kernel, _NR_TYPES, _NR_CONSTS),
    "rms_norm_rope_store": lambda: _sig(norm._rms_norm_rope_kernel, {**_NR_TYPES, "cache_ptr": "*u8"},
                                        {**_NR_CONSTS, "STORE": True, "BNB": 8, "SB": 8}),
    # the indexer's rotation (bf16, 128 dims), alone and with its FP4 rounding in the same kernel
    "hadamard": lambda: _sig(quant._hadamard_kernel, {"x_ptr": "*bf16", "y_ptr": "*bf16", "M": "i32",
                                                      "scale": "fp32"},
                             {"N": 128, "LOGN": 7, "BM": 64, "ITERS": 1, "SPLIT": False, "NATIVE": True}),
    "hadamard_fp4": lambda: _sig(quant._hadamard_kernel, {"x_ptr": "*bf16", "y_ptr": "*bf16", "M": "i32",
                                                          "scale": "fp32"},
                                 {"N": 128, "LOGN": 7, "BM": 64, "ITERS": 1, "SPLIT": False, "NATIVE": True,
                                  "FP4": 32}),
    # a prompt's compressor windows pooled (compress_pool: CSA at flash, 8 slots x 512 channels) and the one-op
    # form that gathers them from the projections and the state (compress_prefill: its pooling for CSA, fresh and
    # continued, then its state store for CSA and HCA)
    "compress_pool": lambda: _sig(compressor._compress_pool_kernel, {
        "kv_ptr": "*fp32", "sc_ptr": "*fp32", "y_ptr": "*fp32", **_ints("SLOTS", "D")}, {"BS": 8, "BD": 512}),
    "compress_prefill_pool": lambda: _sig(compressor._compress_prefill_pool_kernel, _CP_TYPES,
                                          {"OVERLAP": True, "FRESH": True, "BS": 8, "BD": 512}, odd=_CP_ODD),
    "compress_prefill_pool_cont": lambda: _sig(compressor._compress_prefill_pool_kernel, _CP_TYPES,
                                               {"OVERLAP": True, "FRESH": False, "BS": 8, "BD": 512}, odd=_CP_ODD),
    "compress_prefill_state": lambda: _sig(compressor._compress_prefill_state_kernel, _CP_TYPES,
                                           {"FRESH": True, "BS": 8, "BC": 256}, odd=_CP_ODD),
    "compress_prefill_state_hca": lambda: _sig(compressor._compress_prefill_state_kernel, _CP_TYPES,
                                               {"FRESH": False, "BS": 128, "BC": 16}, odd=_CP_ODD),
    # the routing sort's first launch at batch 8 (48 pairs of 256 experts, one chunk): counts, ranks, the padding
    "align_count": lambda: _sig(moe_grouped._align_count_kernel, {
        "e_ptr": "*i64", "cnt_ptr": "*i32", "rank_ptr": "*i32", "rows_ptr": "*i64", **_ints("P", "E", "NR", "FILL")},
        {"BP": 64, "BE": 256, "BF": 256}, odd=("P", "NR", "FILL")),
    # a decode step's position tables (flash: rope_head_dim 64, the CSA and HCA ratios 4 and 128), B = 1
    "decode_tables": lambda: _sig(rope._decode_tables_kernel, {
        "pos_ptr": "*i64", "main_ptr": "*fp32", "comp_ptr": "*fp32", "cs_ptr": "*fp32", "idx_ptr": "*i64",
        "WIN": "i32"}, {"B": 1, "NR": 2, "R0": 4, "R1": 128, "R2": 1, "R3": 1, "ROW": 64, "BR": 64}),
}

OPTIONS = {  # launch options other than the default 4 warps / 3 stages, as the wrappers launch these
    "gg_fp4": {"num_warps": 4, "num_stages": 2}, "gg_fp4_topk": {"num_warps": 4, "num_stages": 2},  # _fp4_config
    "gg_fp4_one_dot": {"num_warps": 4, "num_stages": 2, "maxnreg": moe_grouped.ONE_DOT_MAXNREG},
    "gg_fp8_tma": {"num_warps": 8, "num_stages": 4}, "gg_fp8_tma_topk": {"num_warps": 8, "num_stages": 4},
}


def compile_case(name: str, **options):
    """CASES[name] compiled for sm_90a with its launch options (OPTIONS), `options` overriding them."""
    return triton.compile(CASES[name](), target=TARGET, options={**OPTIONS.get(name, {}), **options})


_DEBUG = re.compile(r"^\s*(\.loc|\.file)\b.*$|//.*$", re.M)


def ptx_digest(name: str) -> str:
    ptx = compile_case(name).asm["ptx"]
    body = "\n".join(ln.rstrip() for ln in _DEBUG.sub("", ptx).splitlines() if ln.strip())
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def main(words: list[str]) -> int:
    for name in CASES:
        if words and not any(w in name for w in words):
            continue
        try:
            print(f"{name:12s} {ptx_digest(name)}")
        except Exception as e:  # noqa: BLE001 - a kernel that does not compile is reported, the rest go on
            print(f"{name:12s} FAILED {type(e).__name__}: {' '.join(str(e).split())[:200]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
