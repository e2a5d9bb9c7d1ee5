"""The warp-specialised folded FP8 form of the routed FP4 experts' grouped GEMM, on sm_90: C[p] = A[p] W[e[p]]^T.

Same numerics and the same output bits as `grouped_fp4.grouped_fp4_fold_kernel` (its docstring has the fold): per
128-K block of a weight row the four per-32 scales fold into one, the nibbles decode to e4m3 x 2^d, one 128-K FP8
MMA per step into a cleared fp32 fragment, promoted into the accumulator times the row's folded weight scale and
the token's activation scale. What changes is the schedule. In that kernel the consumers decode a step's weights,
run the MMA, wait for it and promote, one after the other. Here three warpgroups of one program (128 weight rows
of one expert, one block of BM sorted rows) split it:

* the producer (threads 0-127) only copies, by `cp.async`, into a ring of NS stages, up to NS - 1 steps ahead: the
  BM activation rows gathered straight from A by their row ids (no gathered copy of A beforehand), the packed
  weight rows (64 bytes a row a step, with an L2 prefetch hint), the rows' scale words and the tokens' activation
  scales; the copies land on the stage's `ld` barrier;
* two consumers (threads 128-255: weight rows 0-63, 256-383: rows 64-127) each issue step k's wgmma for their 64
  rows without waiting (`T.wgmma_gemm`), decode their rows of step k + 1 into that stage's e4m3 tile meanwhile
  (published to their own wgmma by a proxy fence and a named barrier of their 128 threads), then wait for the MMA,
  promote it, and release the stage (`free`, both consumers); the producer refills a stage only after `free`.

The roles and barriers are written out: TileLang's own warp specialisation, TMA lowering and bounds guards are off
(`PASS_CONFIGS`). It is a few percent faster than the first fold kernel at the flash expert shapes; the decode
overlap did not buy what the MMA's share of a step promised (see the perf-log, *The folded FP4 GEMM's hand-written
pipeline*). A first schedule with the decode in the producer warpgroup alone was slower than the first kernel: one
warpgroup's decode is slower than two.

No `from __future__ import annotations`: TileLang evaluates the prim_func's annotations.
"""

import tilelang
import tilelang.language as T

from . import grouped_fp4

BN = 128  # weight rows a program: two consumers of 64 (one wgmma M each)
BK = 128  # K a step: one FP8 MMA, one promotion
THREADS = 384
PASS_CONFIGS = {"tl.disable_warp_specialized": True, "tl.disable_tma_lower": True,
                "tl.disable_safe_memory_legalize": True}
SMEM_BYTES = 227 * 1024
BAR_L, BAR_R = 8, 9  # the consumers' named barriers: above TileLang's (0 the block, 1-2 its reductions, 3.. its syncs)

_CP_ASYNC_SRC = r"""
#ifndef DI_CP_ASYNC_PREFETCH
#define DI_CP_ASYNC_PREFETCH
// cp.async of 16 bytes with an L2 prefetch size (PF bytes: 0, 128 or 256): a weight row is read 64 bytes a step,
// so the hint brings the next steps' bytes of the row into L2 with this one.
template <int PF>
__device__ __forceinline__ void di_cp_async16(void* smem, const void* gmem) {
  unsigned int a = static_cast<unsigned int>(__cvta_generic_to_shared(smem));
  if constexpr (PF == 256) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" :: "r"(a), "l"(gmem));
  } else if constexpr (PF == 128) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;" :: "r"(a), "l"(gmem));
  } else {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(a), "l"(gmem));
  }
}
#endif
"""


def stage_bytes(BM: int) -> int:
    """One stage: the A tile, the decoded tile, the packed rows, and three 4-byte vectors (scale words, folded
    scales, activation scales)."""
    return BM * BK + BN * BK + BN * BK // 2 + 4 * (2 * BN + BM)


def stages_for(BM: int, out_bytes: int) -> int:
    """The most stages (4, 3 or 2) that fit beside the output staging tile."""
    for ns in (4, 3, 2):
        if ns * stage_bytes(BM) + BM * BN * out_bytes + 1024 <= SMEM_BYTES:
            return ns
    raise ValueError(f"no stage count fits BM {BM}")


def grouped_fp4_fold_ws_kernel(E: int, N: int, K: int, out_dt: str, BM: int, prefetch: int = 256):
    """A [P, K] e4m3 (the act_quant'd rows), AS [P, K/128] f32 (their scales), W [E*N, K/2] uint8, WS [E*N, K/128]
    int32 (a 128-K block's four ue8m0 bytes as one word), ROWS [NB, BM] int64 (P = pad), BEXP [NB] int64 (-1 =
    unused) -> C [P, N] out_dt; rows of no block untouched (P, NB symbolic). N % 128 == 0, K % 128 == 0, BM 64 or
    128. The weights' scales must fold (`grouped_fp4.fold_ok`). prefetch: the L2 prefetch size (bytes: 0, 128,
    256) of the packed weights' copies."""
    P = T.symbolic("P")
    NB = T.symbolic("NB")
    KB = K // BK
    assert N % BN == 0 and K % BK == 0 and BM in (64, 128), (N, K, BM)
    NS = stages_for(BM, 4 if out_dt == "float32" else 2)
    NI = (KB + NS - 1) // NS
    CA = BM * 8 // 128  # A's 16-byte copies a producer thread makes per step (8 a 128-byte row)
    CW = BN * 4 // 128  # packed weights' 16-byte chunks a producer thread copies per step (4 a row)
    CD = 64 * 4 // 128  # chunks a consumer thread decodes per step: its half's 64 rows x 4 groups

    @T.macro
    def issue(A, AS, W, WS, BEXP, bx, by, tx, ra, k, a_t, wq, wsw, asc, ld):
        """Step k's copies into a stage (`ptx_cp_async` counts elements, not bytes): A rows ra (this thread's),
        the packed weight rows, the scale words, and the activation scales (thread i < BM: row i's, its id in ra's
        slot CA)."""
        for c in T.unroll(CA):
            T.ptx_cp_async(T.access_ptr(a_t[c * 16 + tx // 8, tx % 8 * 16], "w", 16),
                           T.access_ptr(A[ra[c], k * BK + tx % 8 * 16], "r", 16), 16)
        for c in T.unroll(CW):
            T.call_extern("handle", f"di_cp_async16<{prefetch}>", T.address_of(wq[c * 32 + tx // 4, tx % 4 * 16]),
                          T.address_of(W[BEXP[by] * N + bx * BN + c * 32 + tx // 4, k * (BK // 2) + tx % 4 * 16]))
        T.ptx_cp_async(T.access_ptr(wsw[tx], "w", 1), T.access_ptr(WS[BEXP[by] * N + bx * BN + tx, k], "r", 1), 1)
        if tx < BM:
            T.ptx_cp_async(T.access_ptr(asc[tx], "w", 1), T.access_ptr(AS[ra[CA], k], "r", 1), 1)
        T.cp_async_barrier_noinc(ld[0])

    @T.macro
    def decode(px, half, wq, wsw, wsc, wh, src, dec, ld, par, bar_id):
        """The stage's packed rows of this half (64 rows from 64 * half) into its e4m3 tile wh and the rows' folded
        scales; the tile is published to this warpgroup's wgmma by a fence and its own named barrier."""
        T.barrier_wait(ld[0], par)
        for c in T.unroll(CD):
            r = c * 32 + px // 4  # row within the half
            g = px % 4
            wrd = wsw[half * 64 + r]
            _, bmax = grouped_fp4.scale_word_max(wrd)
            if g == 0:
                wsc[half * 64 + r] = grouped_fp4.folded_scale(bmax)
            for v in T.vectorized(16):
                src[v] = wq[half * 64 + r, g * 16 + v]
            T.call_extern("handle", "di_fp4_group_e4m3", T.address_of(src[0]),
                          ((wrd >> (g * 8)) & 0xFF) - bmax + 6, T.address_of(dec[0]))
            for v in T.vectorized(32):
                wh[r, g * 32 + v] = dec[v]
        T.fence_proxy_async()  # the tile (thread writes) is read by the wgmma (the async proxy)
        T.sync_threads(bar_id, 128)

    @T.macro
    def step(px, half, j, k, par_next, wh, a_t, wq, wsw, wsc, asc, ld, free, blk, acc, src, dec, bar_id):
        """Step k (stage j) for a consumer: its MMA issued, step k + 1's rows decoded (ld parity par_next) while it
        runs, then the wait and the promotion; the stage is released after it."""
        T.wgmma_gemm(wh[j], a_t[j], blk, transpose_B=True, clear_accum=True)
        n = (j + 1) % NS
        if k + 1 < KB:
            decode(px, half, wq[n], wsw[n], wsc[n], wh[n], src, dec, ld[n], par_next, bar_id)
        T.wait_wgmma(0)
        for jj, ii in T.Parallel(64, BM):
            acc[jj, ii] += blk[jj, ii] * (wsc[j][half * 64 + jj] * asc[j][ii])
        T.barrier_arrive(free[j][0])

    @T.macro
    def consumer(px, half, wh, a_t, wq, wsw, wsc, asc, ld, free, blk, acc, src, dec, bar_id):
        """Half `half` of the weight rows, step after step. The steps run as whole rounds of NS, then the last
        KB % NS unrolled: a wgmma under a per-step `if` is one ptxas cannot prove uniform, and it then serialises
        it and waits for it before the decode (warnings C7517 / C7518)."""
        decode(px, half, wq[0], wsw[0], wsc[0], wh[0], src, dec, ld[0], 0, bar_id)
        T.clear(acc)
        for i in T.serial(KB // NS):
            for j in tuple(range(NS)):  # unrolled as the IR is built: j picks the stage
                step(px, half, j, i * NS + j, (i + (j + 1) // NS) & 1, wh, a_t, wq, wsw, wsc, asc, ld, free, blk,
                     acc, src, dec, bar_id)
        for j in tuple(range(KB % NS)):
            k = KB // NS * NS + j
            step(px, half, j, k, ((k + 1) // NS) & 1, wh, a_t, wq, wsw, wsc, asc, ld, free, blk, acc, src, dec,
                 bar_id)

    @T.macro
    def store(acc, c_h, ROWS, C, bx, by, half):
        """A consumer's transposed tile acc [64, BM] out to C's rows through c_h [BM, 64] (pad rows not stored)."""
        for j, i in T.Parallel(64, BM):
            c_h[i, j] = T.Cast(out_dt, acc[j, i])
        for i, j in T.Parallel(BM, 64):
            if ROWS[by, i] < P:
                C[ROWS[by, i], bx * BN + half * 64 + j] = c_h[i, j]

    @T.prim_func
    def grouped_fp4_fold_ws(A: T.Tensor((P, K), "float8_e4m3"), AS: T.Tensor((P, KB), "float32"),
                            W: T.Tensor((E * N, K // 2), "uint8"), WS: T.Tensor((E * N, KB), "int32"),
                            ROWS: T.Tensor((NB, BM), "int64"), BEXP: T.Tensor((NB,), "int64"),
                            C: T.Tensor((P, N), out_dt)):
        with T.Kernel(N // BN, NB, threads=THREADS) as (bx, by):
            a_t = [T.alloc_shared((BM, BK), "float8_e4m3") for _ in range(NS)]
            wl = [T.alloc_shared((64, BK), "float8_e4m3") for _ in range(NS)]
            wr = [T.alloc_shared((64, BK), "float8_e4m3") for _ in range(NS)]
            wq = [T.alloc_shared((BN, BK // 2), "uint8") for _ in range(NS)]
            wsw = [T.alloc_shared((BN,), "int32") for _ in range(NS)]
            wsc = [T.alloc_shared((BN,), "float32") for _ in range(NS)]
            asc = [T.alloc_shared((BM,), "float32") for _ in range(NS)]
            ld = [T.alloc_barrier(128) for _ in range(NS)]
            free = [T.alloc_barrier(256) for _ in range(NS)]
            c_l = T.alloc_shared((BM, 64), out_dt)
            c_r = T.alloc_shared((BM, 64), out_dt)
            blk_l = T.alloc_fragment((64, BM), "float32")
            blk_r = T.alloc_fragment((64, BM), "float32")
            acc_l = T.alloc_fragment((64, BM), "float32")
            acc_r = T.alloc_fragment((64, BM), "float32")
            ra = T.alloc_local((CA + 1,), "int32")
            src = T.alloc_local((16,), "uint8")
            dec = T.alloc_local((32,), "float8_e4m3")
            T.import_source(grouped_fp4._DECODE_E4M3_SRC + _CP_ASYNC_SRC)  # one import per kernel
            tx = T.get_thread_binding()
            if BEXP[by] >= 0:  # the expert read where used (see grouped_fp4.grouped_fp4_bf16_kernel)
                if tx < 128:
                    for c in T.unroll(CA):  # pad rows (id P) repeat a real row: finite, never stored
                        ra[c] = T.Cast("int32", T.min(ROWS[by, c * 16 + tx // 8], P - 1))
                    ra[CA] = T.Cast("int32", T.min(ROWS[by, T.min(tx, BM - 1)], P - 1))
                    for i in T.serial(NI):
                        for j in tuple(range(NS)):  # unrolled as the IR is built: j picks the stage
                            k = i * NS + j
                            if k < KB:
                                if k >= NS:  # the stage's last step (k - NS) released by both consumers
                                    T.barrier_wait(free[j][0], (i - 1) & 1)
                                issue(A, AS, W, WS, BEXP, bx, by, tx, ra, k, a_t[j], wq[j], wsw[j], asc[j], ld[j])
                elif tx < 256:
                    consumer(tx - 128, 0, wl, a_t, wq, wsw, wsc, asc, ld, free, blk_l, acc_l, src, dec, BAR_L)
                    store(acc_l, c_l, ROWS, C, bx, by, 0)
                else:
                    consumer(tx - 256, 1, wr, a_t, wq, wsw, wsc, asc, ld, free, blk_r, acc_r, src, dec, BAR_R)
                    store(acc_r, c_r, ROWS, C, bx, by, 1)

    return grouped_fp4_fold_ws


def takes(N: int, K: int, BM: int) -> bool:
    """Shapes this kernel computes: whole 128-row weight tiles and 128-K steps, blocks of 64 or 128 rows."""
    return N % BN == 0 and K % BK == 0 and BM in (64, 128)


def compile_fold_ws(E: int, N: int, K: int, out_dt: str, BM: int):
    return tilelang.compile(grouped_fp4_fold_ws_kernel(E, N, K, out_dt, BM), out_idx=[], pass_configs=PASS_CONFIGS)
