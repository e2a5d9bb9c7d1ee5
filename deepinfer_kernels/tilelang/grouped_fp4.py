"""The routed FP4 experts' grouped GEMM in TileLang, on sm_90, in two forms: C[p] = A[p] W[e[p]]^T.

Both: each program owns BN weight rows of one expert and one block of BM sorted rows (`moe_align`), and computes
the transposed tile C^T = W A^T: the decoded weight tile is the wgmma's M side (64 rows per warpgroup), the block's
tokens its N side, so a block can be as small as 16 rows without padding the MMA to 64. TileLang's TMA producer
warpgroup streams the packed weight tile (BN rows x 64 bytes per 128-K step) and the A tile; the consumers decode
16-byte chunks -- one per-32 scale group, 32 values -- into registers, store them to the decoded tile in shared
memory and run the MMA. A's rows arrive gathered in block order (one launch before the kernel).

The folded FP8 form (`grouped_fp4_fold_kernel`, prefill-sized blocks of 64 and 128 rows): per 128-K block of a
weight row the four per-32 scales fold into their largest / 2^6 (convert.py's fold, per row instead of per 128
rows); each group's nibbles decode to e4m3 times 2^d, d = its scale's offset from that, by two byte permutes
(`_DECODE_E4M3_SRC`: an 8-entry magnitude table with d added to its exponent fields, then the signs). Exact while
d >= -5 (every value a normal e4m3), i.e. the four scales lie within 2^11 -- `fold_ok` checks each weight once.
A is the act_quant'd e4m3 itself, so the per-32 weight scales meet the per-128 activation scales as one power of
two per (weight row, token, 128-K block), applied when the block's FP8 MMA is promoted into the fp32 accumulator
(DeepGEMM's per-128 promotion; inside a block the tensor core keeps ~14 bits of its sums). Where N % 128 == 0,
`grouped_fp4_ws.py` runs it as a hand-written warp-specialised pipeline (same bits); this file's kernel takes the
64-row weight tiles.

The bf16 form (`grouped_fp4_bf16_kernel`, every block size and scale pattern): A comes as `bf16_split(q, s)`
rows ([P, K] bf16: e4m3 x its per-128 power-of-two scale, exact; each 128-K block as its 64 even then its 64 odd
columns), the form the Triton kernel reads; producers that write it pass it as `a_split`, otherwise
`gather_split_kernel` converts the act_quant'd rows. The low nibbles go to columns 0-63, the high to 64-127. The
decode is bit placement (`_DECODE_SRC`): two packed bytes b0, b1 become [0, b0, 0, b1] by one byte permute;
shifted and masked, a nibble s|e1 e0 m lands at bf16 bit 15 and bits 8..6 and reads as e2m1 x 2^-126 (e = 0: the
subnormal m x 2^-127), so one exact bf16x2 multiply by 2^126 and one by the group scale 2^(b-127) give the
weight; both products are powers-of-two rescalings of 2-significant-bit values, exact for every scale byte (bf16
keeps fp32's exponent range and its subnormals). The whole K then accumulates in fp32 in the tensor core.

`run` takes the folded form where it applies under `DEEPINFER_TL_FP4=fold`, else the bf16 form (the default); `moe.py` keeps the
official per-32 FP8 form (`grouped_fp4_kernel`, `DEEPINFER_TL_FP4=fp8`) and the shapes neither form takes.

No `from __future__ import annotations`: TileLang evaluates the prim_func's annotations.
"""

from collections import Counter

import tilelang
import tilelang.language as T
import torch

from . import grouped_fp4_ws
from ._common import expert_blocks

_DECODE_SRC = r"""
#ifndef DI_FP4_GROUP_BF16
#define DI_FP4_GROUP_BF16
// 16 packed e2m1 bytes (one per-32 scale group) and its ue8m0 scale byte -> the 16 low-nibble values (lo) and
// the 16 high-nibble values (hi) as bf16, in byte order.
__device__ __forceinline__ void di_fp4_group_bf16(const unsigned char* src, unsigned char sb, void* lo, void* hi) {
  const unsigned int* s32 = reinterpret_cast<const unsigned int*>(src);
  unsigned int* l32 = reinterpret_cast<unsigned int*>(lo);
  unsigned int* h32 = reinterpret_cast<unsigned int*>(hi);
  unsigned int s16 = sb ? (sb == 255u ? 0x7FC0u : ((unsigned int)sb << 7)) : 0x40u;  // 2^(b-127) as bf16
  unsigned int sc = s16 | (s16 << 16);
  const unsigned int k126 = 0x7E807E80u;  // 2^126 in both halves
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    unsigned int v = s32[w];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      unsigned int x, y, u;
      // [0, b0, 0, b1] from bytes 2h, 2h+1 of v
      asm("prmt.b32 %0, %1, 0, %2;" : "=r"(x) : "r"(v), "r"(h ? 0x3424u : 0x1404u));
      y = ((x << 4) | (x >> 2)) & 0x81C081C0u;
      u = x & 0xF000F000u;
      x = (u | (u >> 6)) & 0x81C081C0u;
      asm("mul.rn.bf16x2 %0, %0, %1;" : "+r"(y) : "r"(k126));
      asm("mul.rn.bf16x2 %0, %0, %1;" : "+r"(y) : "r"(sc));
      asm("mul.rn.bf16x2 %0, %0, %1;" : "+r"(x) : "r"(k126));
      asm("mul.rn.bf16x2 %0, %0, %1;" : "+r"(x) : "r"(sc));
      l32[2 * w + h] = y;
      h32[2 * w + h] = x;
    }
  }
}
#endif
"""


_DECODE_E4M3_SRC = r"""
#ifndef DI_FP4_GROUP_E4M3
#define DI_FP4_GROUP_E4M3
// 16 packed e2m1 bytes (one per-32 scale group, K order: low nibble first) -> its 32 values x 2^d as e4m3 bytes
// in K order, for d in [-5, 6] (every result a normal e4m3, so exact). A byte permute reads four magnitudes from
// an 8-entry table (0, 0.5, 1, 1.5, 2, 3, 4, 6 as e4m3, every non-zero exponent field raised by d), a second one
// places the four sign bits.
__device__ __forceinline__ void di_fp4_group_e4m3(const unsigned char* src, int d, void* dst) {
  const unsigned int* s32 = reinterpret_cast<const unsigned int*>(src);
  unsigned int* o32 = reinterpret_cast<unsigned int*>(dst);
  unsigned int off = (unsigned int)(d * 8);
  unsigned int la = 0x3C383000u + off * 0x01010100u;  // magnitudes 0-3: 0, 0.5, 1, 1.5
  unsigned int lb = 0x4C484440u + off * 0x01010101u;  // magnitudes 4-7: 2, 3, 4, 6
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    unsigned int v = s32[w];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      unsigned int x = h ? (v >> 16) : v, m, g;
      asm("prmt.b32 %0, %1, %2, %3;" : "=r"(m) : "r"(la), "r"(lb), "r"(x & 0x7777u));
      asm("prmt.b32 %0, %1, %2, %3;" : "=r"(g) : "r"(0u), "r"(0x80808080u), "r"((x >> 1) & 0x4444u));
      o32[2 * w + h] = m | g;
    }
  }
}
#endif
"""

FOLD_SPREAD = 11  # a 128-K block's group scales within 2^11: each group's shift d lies in [-5, 6]
FORMS_RUN: Counter = Counter()  # calls per form ("fold", "bf16") in this process: which form a call took


def scale_word_max(wrd):
    """A 128-K block's scale word (its four ue8m0 bytes, group g in byte g) -> the bytes and their largest, bmax."""
    b = (wrd & 0xFF, (wrd >> 8) & 0xFF, (wrd >> 16) & 0xFF, (wrd >> 24) & 0xFF)
    return b, T.max(T.max(b[0], b[1]), T.max(b[2], b[3]))


def folded_scale(bmax):
    """The block's folded weight scale 2^(bmax - 133) as f32, from its bits: normal from bmax = 7, below that a
    subnormal's single bit."""
    return T.reinterpret("float32", T.if_then_else(bmax >= 7, (bmax - 6) << 23, T.shift_left(1, bmax + 16)))


@T.macro
def _load_step(W, A, BEXP, wq, a_t, bx, by, k, N, BN, BM, BK):
    """The K step's tiles: block by's expert's packed weight rows bx*BN.. (BK/2 bytes) and the block's BM activation
    rows. The expert is read where it is used (see grouped_fp4_bf16_kernel), not bound to a local."""
    T.copy(W[BEXP[by] * N + bx * BN:BEXP[by] * N + bx * BN + BN, k * (BK // 2):(k + 1) * (BK // 2)], wq)
    T.copy(A[by * BM:(by + 1) * BM, k * BK:(k + 1) * BK], a_t)


@T.macro
def _store_rows(acc, c_t, rows, C, bx, P, BN, BM, out_dt):
    """The transposed tile acc [BN, BM] out to C's rows (block rows past P are padding: not stored)."""
    for j, i in T.Parallel(BN, BM):
        c_t[i, j] = T.Cast(out_dt, acc[j, i])
    for i, j in T.Parallel(BM, BN):
        if rows[i] < P:
            C[rows[i], bx * BN + j] = c_t[i, j]


def grouped_fp4_fold_kernel(E: int, N: int, K: int, out_dt: str, BM: int, BN: int = 128, stages: int = 3):
    """The folded FP8 form. A [NB*BM, K] e4m3 (the act_quant'd rows gathered in block order), AST [K/128, NB*BM]
    f32 (their per-128 scales, transposed), W [E*N, K/2] uint8, WS [E*N, K/128] int32 (a 128-K block's four ue8m0
    bytes, the checkpoint's [E*N, K/32] bytes viewed as words), ROWS [NB, BM] int64 (P = pad), BEXP [NB] int64
    (-1 = unused) -> C [P, N] out_dt; rows of no block untouched.

    Per 128-K block of a weight row the four per-32 scales 2^(b_g - 127) fold into one, 2^(b_max - 133): group g's
    nibbles decode to e4m3 times 2^d, d = b_g - b_max + 6, exact while every d >= -5 (`fold_ok` checks the whole
    weight: spread <= FOLD_SPREAD). Then one 128-K FP8 MMA per step into a cleared fp32 fragment, promoted into
    the fp32 accumulator times the row's folded weight scale and the token's activation scale. The folded scales
    and the four d (as bytes d + 8 of one word) of the program's rows, and its rows' activation scales, are
    computed / loaded once before the K loop, K-block-major so that the promotion's and the decode's shared reads
    are conflict-free. N % BN == 0, K % 128 == 0, BN a multiple of 64."""
    P = T.symbolic("P")
    NB = T.symbolic("NB")
    BK = 128
    KB = K // BK
    threads = 2 * BN
    CH = BN * 4 // threads
    assert N % BN == 0 and K % BK == 0 and BN % 64 == 0

    @T.prim_func
    def grouped_fp4_fold_k(A: T.Tensor((NB * BM, K), "float8_e4m3"), AST: T.Tensor((KB, NB * BM), "float32"),
                           W: T.Tensor((E * N, K // 2), "uint8"), WS: T.Tensor((E * N, KB), "int32"),
                           ROWS: T.Tensor((NB, BM), "int64"), BEXP: T.Tensor((NB,), "int64"),
                           C: T.Tensor((P, N), out_dt)):
        with T.Kernel(N // BN, NB, threads=threads) as (bx, by):
            wq = T.alloc_shared((BN, BK // 2), "uint8")
            wsb = T.alloc_shared((KB, BN), "float32")
            dpk = T.alloc_shared((KB, BN), "int32")
            asb = T.alloc_shared((KB, BM), "float32")
            wd = T.alloc_shared((BN, BK), "float8_e4m3")
            a_t = T.alloc_shared((BM, BK), "float8_e4m3")
            c_t = T.alloc_shared((BM, BN), out_dt)
            rows = T.alloc_shared((BM,), "int64")
            acc = T.alloc_fragment((BN, BM), "float32")
            blk = T.alloc_fragment((BN, BM), "float32")
            src = T.alloc_local((16,), "uint8")
            dec = T.alloc_local((32,), "float8_e4m3")
            T.import_source(_DECODE_E4M3_SRC)
            tx = T.get_thread_binding()
            if BEXP[by] >= 0:  # the expert read where used (see grouped_fp4_bf16_kernel)
                for i in T.Parallel(BM):
                    rows[i] = ROWS[by, i]
                # plain loads, not T.copy: TileLang 0.1.15 waits for a TMA copy at its first use inside the
                # pipelined loop, so a prologue reading a TMA'd tile would read it before it lands
                for kb, i in T.Parallel(KB, BM):
                    asb[kb, i] = AST[kb, by * BM + i]
                for kb, j in T.Parallel(KB, BN):
                    wrd = WS[BEXP[by] * N + bx * BN + j, kb]
                    (b0, b1, b2, b3), bmax = scale_word_max(wrd)
                    wsb[kb, j] = folded_scale(bmax)
                    dpk[kb, j] = ((b0 - bmax + 14) | ((b1 - bmax + 14) << 8) | ((b2 - bmax + 14) << 16)
                                  | ((b3 - bmax + 14) << 24))
                T.clear(acc)
                for k in T.Pipelined(KB, num_stages=stages):
                    _load_step(W, A, BEXP, wq, a_t, bx, by, k, N, BN, BM, BK)
                    for c in T.serial(CH):
                        r = (c * threads + tx) // 4
                        g = (c * threads + tx) % 4
                        for v in T.vectorized(16):
                            src[v] = wq[r, g * 16 + v]
                        T.call_extern("handle", "di_fp4_group_e4m3", T.address_of(src[0]),
                                      ((dpk[k, r] >> (g * 8)) & 0xFF) - 8, T.address_of(dec[0]))
                        for v in T.vectorized(32):
                            wd[r, g * 32 + v] = dec[v]
                    T.gemm(wd, a_t, blk, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                    for j, i in T.Parallel(BN, BM):
                        acc[j, i] += blk[j, i] * (wsb[k, j] * asb[k, i])
                _store_rows(acc, c_t, rows, C, bx, P, BN, BM, out_dt)

    return grouped_fp4_fold_k


def grouped_fp4_bf16_kernel(E: int, N: int, K: int, out_dt: str, BM: int, BN: int = 128, stages: int = 2):
    """A [NB*BM, K] bf16 split rows in block order (`gather_split`), W [E*N, K/2] uint8, WS [E*N, K/32] uint8
    (ue8m0), ROWS [NB, BM] int64 (P = pad), BEXP [NB] int64 (-1 = unused) -> C [P, N] out_dt; rows of no block
    untouched (P, NB symbolic). N % BN == 0, K % 128 == 0; BN a multiple of 64 (a warpgroup per 64 weight rows).
    The scale bytes of the program's BN rows (all of K) are loaded once, before the K loop."""
    P = T.symbolic("P")
    NB = T.symbolic("NB")
    BK = 128
    threads = 2 * BN  # BN / 64 warpgroups
    CH = BN * 4 // threads  # 16-byte chunks per thread per step
    assert N % BN == 0 and K % BK == 0 and BN % 64 == 0

    @T.prim_func
    def grouped_fp4_bf16_k(A: T.Tensor((NB * BM, K), "bfloat16"), W: T.Tensor((E * N, K // 2), "uint8"),
                           WS: T.Tensor((E * N, K // 32), "uint8"), ROWS: T.Tensor((NB, BM), "int64"),
                           BEXP: T.Tensor((NB,), "int64"), C: T.Tensor((P, N), out_dt)):
        with T.Kernel(N // BN, NB, threads=threads) as (bx, by):
            wq = T.alloc_shared((BN, BK // 2), "uint8")
            sc = T.alloc_shared((BN, K // 32), "uint8")
            wd = T.alloc_shared((BN, BK), "bfloat16")
            a_t = T.alloc_shared((BM, BK), "bfloat16")
            c_t = T.alloc_shared((BM, BN), out_dt)
            rows = T.alloc_shared((BM,), "int64")
            acc = T.alloc_fragment((BN, BM), "float32")
            src = T.alloc_local((16,), "uint8")
            lo = T.alloc_local((16,), "bfloat16")
            hi = T.alloc_local((16,), "bfloat16")
            T.import_source(_DECODE_SRC)
            tx = T.get_thread_binding()
            # the expert is read where it is used, not kept in a local: TileLang 0.1.15's warp specialisation
            # moved a local's assignment below its first use (an earlier staged form wrote zeros)
            if BEXP[by] >= 0:
                for i in T.Parallel(BM):
                    rows[i] = ROWS[by, i]
                T.copy(WS[BEXP[by] * N + bx * BN:BEXP[by] * N + bx * BN + BN, 0:K // 32], sc)
                T.clear(acc)
                for k in T.Pipelined(K // BK, num_stages=stages):
                    _load_step(W, A, BEXP, wq, a_t, bx, by, k, N, BN, BM, BK)
                    for c in T.serial(CH):
                        r = (c * threads + tx) // 4
                        g = (c * threads + tx) % 4
                        for v in T.vectorized(16):
                            src[v] = wq[r, g * 16 + v]
                        T.call_extern("handle", "di_fp4_group_bf16", T.address_of(src[0]), sc[r, k * 4 + g],
                                      T.address_of(lo[0]), T.address_of(hi[0]))
                        for v in T.vectorized(16):
                            wd[r, g * 16 + v] = lo[v]
                        for v in T.vectorized(16):
                            wd[r, 64 + g * 16 + v] = hi[v]
                    T.gemm(wd, a_t, acc, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                _store_rows(acc, c_t, rows, C, bx, P, BN, BM, out_dt)

    return grouped_fp4_bf16_k


def gather_split_kernel(K: int, BM: int):
    """Q [P, K] e4m3, S [P, K/128] f32, ROWS [R] int64 (R = NB * BM; P = pad) -> O [R, K] bf16: row r is
    `bf16_split` of row min(ROWS[r], P - 1) (each 128-K block's even then odd columns, times the block's
    scale; exact). Pad rows repeat a real row: finite, and their outputs are never stored."""
    P = T.symbolic("P")
    R = T.symbolic("R")
    BR = 16  # rows per program; a thread per (row, 16-column chunk of the 128-K block)

    @T.prim_func
    def gather_split_k(Q: T.Tensor((P, K), "float8_e4m3"), S: T.Tensor((P, K // 128), "float32"),
                       ROWS: T.Tensor((R,), "int64"), O: T.Tensor((R, K), "bfloat16")):
        with T.Kernel(T.ceildiv(R, BR), K // 128, threads=BR * 8) as (bx, kb):
            q = T.alloc_local((16,), "float8_e4m3")
            lo = T.alloc_local((8,), "bfloat16")
            hi = T.alloc_local((8,), "bfloat16")
            s = T.alloc_local((1,), "float32")
            tx = T.get_thread_binding()
            r = bx * BR + tx // 8
            c = tx % 8  # columns 16c .. 16c + 15: pairs 8c .. 8c + 7
            if r < R:
                src = T.min(ROWS[r], P - 1)
                s[0] = S[src, kb]
                for v in T.vectorized(16):
                    q[v] = Q[src, kb * 128 + c * 16 + v]
                for v in T.serial(8):
                    lo[v] = T.Cast("bfloat16", T.Cast("float32", q[2 * v]) * s[0])
                    hi[v] = T.Cast("bfloat16", T.Cast("float32", q[2 * v + 1]) * s[0])
                for v in T.vectorized(8):
                    O[r, kb * 128 + c * 8 + v] = lo[v]
                for v in T.vectorized(8):
                    O[r, kb * 128 + 64 + c * 8 + v] = hi[v]

    return gather_split_k


def block_rows(P: int, E: int) -> int:
    """Rows per block (the MMA's N side): 16 at decode sizes; at prefill 128 where the experts average >= 64 rows,
    else 64: at flash w1|w3 / w2, 128-row blocks are much faster at ~96 rows per expert and slower at ~48
    (docs/perf-log.md, "The TileLang grouped FP4 GEMM's bf16 form")."""
    if P <= 256:
        return 16
    return 128 if P >= 64 * E else 64


def run(a, a_s, e, w, w_s, out_dtype, a_split, build, dt, fold=False):
    """C [P, N] out_dtype (rows with e = -1: 0) for a [P, K] e4m3 + a_s [P, K/128] (or their split form
    a_split [P, K] bf16), w [E, N, K/2] packed e2m1, w_s [E, N, K/32] (ue8m0 bytes or f32 powers of two).
    fold: the folded FP8 form at 64- and 128-row blocks where `fold_ok(w_s)` (grouped_fp4_ws.py's warp-specialised
    kernel where N % 128 == 0, else grouped_fp4_fold_kernel at 64-row weight tiles), else the bf16 form (both
    exact in the weights). build(key, make) compiles once per key (the backend's cache; None when the build failed)."""
    P, K = a.shape
    E, N = w.size(0), w.size(1)
    BM = block_rows(P, E)
    stages = 3 if BM == 128 else 2
    fold = fold and BM >= 64 and fold_ok(w_s)
    fold_ws = fold and grouped_fp4_ws.takes(N, K, BM)
    if fold_ws:
        kern = build(("fp4-fold-ws", E, N, K, dt, BM), lambda: grouped_fp4_ws.compile_fold_ws(E, N, K, dt, BM))
    elif fold:
        kern = build(("fp4-fold", E, N, K, dt, BM), lambda: compile_grouped(E, N, K, dt, BM, stages, fold=True))
    else:
        kern = build(("fp4-bf16", E, N, K, dt, BM), lambda: compile_grouped(E, N, K, dt, BM, stages))
        if a_split is None:
            gath = build(("gather-split", K, BM), lambda: compile_gather_split(K, BM))
            if gath is None:
                return None
    if kern is None:
        return None
    c, rows, bexp = expert_blocks(e, P, N, E, BM, out_dtype)
    if rows is None:
        return c
    ws = scale_bytes(w_s).contiguous().view(E * N, K // 32)
    wq = w.contiguous().view(torch.uint8).view(E * N, K // 2)
    FORMS_RUN["fold" if fold else "bf16"] += 1
    if fold_ws:  # gathers A's rows itself
        kern(a.contiguous(), a_s.float().contiguous(), wq, ws.view(torch.int32).view(E * N, K // 128),
             rows.view(-1, BM), bexp, c)
        return c
    src = rows.clamp(max=P - 1)  # pad rows repeat a real row: finite, and their outputs are never stored
    if fold:
        a2 = a.contiguous().view(torch.uint8).index_select(0, src).view(torch.float8_e4m3fn)
        ast = a_s.float().t().index_select(1, src).contiguous()
        kern(a2, ast, wq, ws.view(torch.int32).view(E * N, K // 128), rows.view(-1, BM), bexp, c)
        return c
    if a_split is None:
        a2 = torch.empty(rows.numel(), K, dtype=torch.bfloat16, device=a.device)
        gath(a.contiguous(), a_s.float().contiguous(), rows, a2)
    else:
        a2 = a_split.index_select(0, src)
    kern(a2, wq, ws, rows.view(-1, BM), bexp, c)
    return c


def fold_ok(w_s: torch.Tensor) -> bool:
    """Every 128-K block of this weight has its four per-32 scales within 2^FOLD_SPREAD of each other and none is
    NaN (byte 255): the folded FP8 form is exact for it. Read once per scale tensor -- one host sync at its first
    prefill-sized GEMM (the engine's warm-up runs before any graph capture; a first call inside a capture fails
    with CUDA's capture error, never silently) -- and kept on the tensor object (weights are not modified in
    place)."""
    flag = getattr(w_s, "_deepinfer_fp4_fold", None)
    if flag is None:
        b = scale_bytes(w_s).reshape(-1, 4)
        if b.numel() == 0:
            flag = True
        else:
            lo, hi = b.amin(1).short(), b.amax(1).short()
            flag = bool((((hi - lo).max() <= FOLD_SPREAD) & (hi.max() < 255)).item())  # one host sync
        w_s._deepinfer_fp4_fold = flag
    return flag


def compile_grouped(E: int, N: int, K: int, out_dt: str, BM: int, stages: int = 2, ws: bool = True,
                    fold: bool = False):
    """The compiled grouped kernel (fold: the folded FP8 form, else the bf16 form); BN 128 where N allows, else
    64. ws=False: TileLang's software pipeline with cp.async stages instead of its warp-specialised producer (a
    sweep option, `pass_configs`)."""
    make = grouped_fp4_fold_kernel if fold else grouped_fp4_bf16_kernel
    f = make(E, N, K, out_dt, BM, 128 if N % 128 == 0 else 64, stages)
    return tilelang.compile(f, out_idx=[], pass_configs={"tl.disable_warp_specialized": not ws})


def compile_gather_split(K: int, BM: int):
    return tilelang.compile(gather_split_kernel(K, BM), out_idx=[])


def takes(N: int, K: int) -> bool:
    """Shapes this kernel computes: N a multiple of 64, K of 128."""
    return N % 64 == 0 and K % 128 == 0


def scale_bytes(w_s: torch.Tensor) -> torch.Tensor:
    """The per-32 weight scales as raw ue8m0 bytes (the checkpoint's form; f32 powers of two converted)."""
    from deepinfer.quant.formats import float_to_e8m0

    if w_s.dtype == torch.uint8:
        return w_s
    if w_s.dtype == torch.float8_e8m0fnu:
        return w_s.view(torch.uint8)
    return float_to_e8m0(w_s.float())
