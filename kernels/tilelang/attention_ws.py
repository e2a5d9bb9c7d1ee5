"""The warp-specialised form of TileLang's sparse attention with sink (`sparse_attn`), for 64-head blocks on sm_90.

The plain kernel (attention.py) gathers a block of kv rows, then multiplies, then gathers the next: the gather and
the tensor core take turns. Here three warpgroups of one program (one query token, 64 heads) overlap them:

* the scorer (threads 0-127) waits for a stage, computes the block's logits Q Kᵀ over all of D, the running max
  and p = exp(logit - max) as the reference rounds them, writes p (operand dtype) and the rescale factor to
  shared memory, and goes on to the next block's Q Kᵀ;
* two accumulators (threads 128-255: the left half of D, 256-383: the right half) each rescale their half of the
  output by that factor and accumulate P V; then each gathers its half of the block two ahead into the stage it
  has just read, by `cp.async` (16 bytes a copy, 8 threads a row; an empty slot's copy reads nothing and writes
  zeros). The left one also copies that block's 64 slot ids for the scorer's mask.

The scorer holds no output, so the tensor core runs one block's Q Kᵀ while the accumulators run the previous
block's P V. With half the output in the scorer and a separate producer warpgroup (the split of FlashMLA's sparse
prefill and TileLang's V3.2 sparse MLA, this kernel's first form) Q Kᵀ, softmax and P V sat on one warpgroup's
path block after block: 276 TFLOP/s against 340 now (H200, prefill 4096, K 640). A fourth warpgroup does not fit:
512 threads leave 128 registers a thread, and ptxas needs 154 for the accumulators' 64 x 256 wgmma. A stage half
needs no release barrier: the scorer read it before it published p (`p_ready`), and only its own accumulator
writes it. Numerics are the plain kernel's and the reference's (`sparse_attn`): blocks of 64 slots in idx order,
logits (q . kv) * scale in fp32, empty slots -inf, the running max over the logits only, p summed in fp32 and cast
to the operands' dtype for P V, the sink joining the denominator last, 0 for a token with no valid slot. Two
differences of a few fp32 ulp: the block's exponentials are exp2(x log2 e) on the hardware's ex2 (as Triton's
tl.exp), and the output is the accumulator times 1 / l (the plain kernel's too) rather than divided per element: a
correctly rounded division is ~15 instructions, and 128 of them a thread were most of the first form's epilogue,
18 % of its scorer's stall samples.
Slot ids are trusted to lie in [-1, N), as the model writes them: the gather has no bounds guard (TileLang's
guard would turn each cp.async into a guarded load).

Shared memory at D = 512: Q 64 KB (reused for the output), two stages of 64 rows 128 KB, p 8 KB.

No `from __future__ import annotations`: TileLang evaluates the prim_func's annotations.
"""

import tilelang.language as T

from deepinfer.ops.reference import SPARSE_ATTN_BLOCK

BLK = SPARSE_ATTN_BLOCK  # 64 slots a block, as the official kernel and the reference
HB = 64  # heads a program: one warpgroup's wgmma M
THREADS = 384
PASS_CONFIGS = {"tl.disable_warp_specialized": True, "tl.disable_tma_lower": True,
                "tl.disable_safe_memory_legalize": True}
"""The roles and their barriers are written out here: TileLang's own warp specialisation and TMA lowering stay off,
and so do its bounds guards (the cp.async gather is emitted as written)."""


@T.macro
def online_softmax(lg, m, m_prev, bm, rs, l, H: int, BLK: int, exp):
    """One block of the reference's online softmax, in place: logits lg [H, BLK] (empty slots -inf) -> p = exp(lg -
    max); the running max m and denominator l, and rs = exp(m_prev - m), the factor the output accumulator is to
    be rescaled by. m_prev and bm are scratch. `exp` is the exponential the kernel rounds with (a Python callable
    of a TIR value)."""
    T.copy(m, m_prev)
    T.reduce_max(lg, bm, dim=1, clear=True)
    for h in T.Parallel(H):
        m[h] = T.max(m_prev[h], bm[h])
        # no valid slot yet: exponentials against 0 (exp(-inf) = 0, nothing to rescale)
        bm[h] = T.if_then_else(m[h] == -T.infinity("float32"), T.float32(0), m[h])
        rs[h] = exp(m_prev[h] - bm[h])
    for h, j in T.Parallel(H, BLK):
        lg[h, j] = exp(lg[h, j] - bm[h])
    T.reduce_sum(lg, m_prev, dim=1, clear=True)  # the block's sum of p (m_prev is free here)
    for h in T.Parallel(H):
        l[h] = l[h] * rs[h] + m_prev[h]


def ws_fits(H: int, D: int) -> bool:
    """Whether the warp-specialised form takes this shape: D splits into two halves of whole 64-element rows
    (an accumulator's 8 threads x 8 elements a row) and fits the shared memory (D <= 512)."""
    return D % 128 == 0 and D <= 512 and H > 0


def sparse_attn_ws_kernel(H: int, D: int, K: int, dt: str, scale: float):
    """Q [T, H, D], KV [B, N, D], SINK [H] f32, IDX [T, K] int32, BT [T] int32 (each token's batch) ->
    O [T, H, D] (T, B, N symbolic; H a multiple of 64, D of 128). One program per (token, 64-head block)."""
    Tn, Bn, N = T.symbolic("T"), T.symbolic("B"), T.symbolic("N")
    NHB = H // HB
    NBLK = (K + BLK - 1) // BLK
    NPAIR = (NBLK + 1) // 2  # the stages alternate; an odd last block's partner is all empty slots (-inf, p = 0)
    DH = D // 2
    U = DH // 64  # 16-byte copies per thread per half-row
    NEG = -T.infinity("float32")
    LOG2E = 1.4426950408889634  # exp(x) as exp2(x log2 e), the hardware's ex2 (as Triton's exp)

    @T.macro
    def slot_ids(IDX, t, px, kb, ix):
        """This thread's 4 rows' slot ids of block kb (-1 past K), loaded ahead of the gather that uses them."""
        for r in T.unroll(BLK // 16):
            ix[r] = T.if_then_else(kb * BLK + r * 16 + px // 8 < K,
                                   IDX[t, T.min(kb * BLK + r * 16 + px // 8, K - 1)], -1)

    @T.macro
    def gather(KV, IDX, b, t, px, half, kvh, ids, ready, kb, ix, off):
        """Half `off` of block kb's kv rows into kvh (an empty slot's copy reads nothing and writes 16 zero bytes);
        the left half's warpgroup also copies the block's slot ids (past K: 0, which the mask tells by position)."""
        if half == 0 and px < BLK:
            T.ptx_cp_async(T.access_ptr(ids[px], "w", 1), T.access_ptr(IDX[t, T.min(kb * BLK + px, K - 1)], "r", 1),
                           1, predicate=kb * BLK + px < K)
        for r in T.unroll(BLK // 16):
            for u in T.unroll(U):
                c = 64 * u + px % 8 * 8
                T.ptx_cp_async(T.access_ptr(kvh[r * 16 + px // 8, c], "w", 8),
                               T.access_ptr(KV[b, T.max(ix[r], 0), off + c], "r", 8), 8, predicate=ix[r] >= 0)
        T.cp_async_barrier_noinc(ready[0])

    @T.macro
    def score(ql, qr, kvl, kvr, ids, ready, kb, par, lg, m, m_prev, bm, rs, l, p_s, rs_s, p_ready, p_free):
        T.barrier_wait(ready[0], par)
        for h, j in T.Parallel(HB, BLK):  # empty slots and those past K: -inf
            lg[h, j] = T.if_then_else((kb * BLK + j < K) & (ids[j] >= 0), T.float32(0), NEG)
        T.gemm(ql, kvl, lg, transpose_B=True)
        T.gemm(qr, kvr, lg, transpose_B=True)
        for h, j in T.Parallel(HB, BLK):
            lg[h, j] = lg[h, j] * T.float32(scale)
        online_softmax(lg, m, m_prev, bm, rs, l, HB, BLK, lambda x: T.exp2(x * T.float32(LOG2E)))
        if kb > 0:
            T.barrier_wait(p_free[0], (kb - 1) & 1)  # the accumulators done with the previous block's p and factor
        T.copy(lg, p_s)
        for h in T.Parallel(HB):
            rs_s[h] = rs[h]
        T.fence_proxy_async()  # p (written by threads) is read by the accumulators' wgmma (the async proxy)
        T.barrier_arrive(p_ready[0])

    @T.macro
    def accumulate(KV, IDX, b, t, px, half, kvh, ids, ready, kb, ix, acc, p_s, rs_s, p_ready, p_free):
        """Block kb's P V for this half of D, then this half of block kb + 2's rows into the stage just read (ix holds
        their slot ids, loaded after block kb - 2's P V: in a decode their latency would otherwise stall each
        gather), then block kb + 4's slot ids."""
        T.barrier_wait(p_ready[0], kb & 1)
        for h, d in T.Parallel(HB, DH):
            acc[h, d] *= rs_s[h]
        T.gemm(p_s, kvh, acc)
        if kb + 2 < 2 * NPAIR:  # the scorer read this stage before p_ready; the other half is the other group's
            gather(KV, IDX, b, t, px, half, kvh, ids, ready, kb + 2, ix, half * DH)
            slot_ids(IDX, t, px, kb + 4, ix)
        T.barrier_arrive(p_free[0])

    @T.macro
    def accumulator(KV, IDX, O, b, t, h0, px, half, kvh0, kvh1, ids0, ids1, ready0, ready1, ix0, ix1, acc, p_s,
                    rs_s, inv_s, p_ready, p_free, l_ready, o_s):
        """One half of D: the first two blocks' rows, then P V block after block, then the output. ix0 / ix1: the
        slot ids of the next even / odd block this thread gathers."""
        slot_ids(IDX, t, px, 0, ix0)
        slot_ids(IDX, t, px, 1, ix1)
        gather(KV, IDX, b, t, px, half, kvh0, ids0, ready0, 0, ix0, half * DH)
        gather(KV, IDX, b, t, px, half, kvh1, ids1, ready1, 1, ix1, half * DH)
        slot_ids(IDX, t, px, 2, ix0)
        slot_ids(IDX, t, px, 3, ix1)
        T.clear(acc)
        for i in T.serial(NPAIR):
            accumulate(KV, IDX, b, t, px, half, kvh0, ids0, ready0, 2 * i, ix0, acc, p_s, rs_s, p_ready, p_free)
            accumulate(KV, IDX, b, t, px, half, kvh1, ids1, ready1, 2 * i + 1, ix1, acc, p_s, rs_s, p_ready, p_free)
        T.barrier_wait(l_ready[0], 0)
        for h, d in T.Parallel(HB, DH):
            acc[h, d] = acc[h, d] * inv_s[h]
        T.copy(acc, o_s)  # Q's last reader, the scorer's last Q Kᵀ, came before the last p waited for
        T.copy(o_s, O[t, h0:h0 + HB, half * DH:half * DH + DH])

    @T.prim_func
    def sparse_attn_ws(Q: T.Tensor((Tn, H, D), dt), KV: T.Tensor((Bn, N, D), dt), SINK: T.Tensor((H,), "float32"),
                       IDX: T.Tensor((Tn, K), "int32"), BT: T.Tensor((Tn,), "int32"), O: T.Tensor((Tn, H, D), dt)):
        with T.Kernel(Tn * NHB, threads=THREADS) as bx:
            ql = T.alloc_shared((HB, DH), dt)
            qr = T.alloc_shared((HB, DH), dt)
            kvl0 = T.alloc_shared((BLK, DH), dt)
            kvr0 = T.alloc_shared((BLK, DH), dt)
            kvl1 = T.alloc_shared((BLK, DH), dt)
            kvr1 = T.alloc_shared((BLK, DH), dt)
            ids0 = T.alloc_shared((BLK,), "int32")
            ids1 = T.alloc_shared((BLK,), "int32")
            p_s = T.alloc_shared((HB, BLK), dt)
            rs_s = T.alloc_shared((HB,), "float32")
            inv_s = T.alloc_shared((HB,), "float32")
            lg = T.alloc_fragment((HB, BLK), "float32")
            acc_l = T.alloc_fragment((HB, DH), "float32")
            acc_r = T.alloc_fragment((HB, DH), "float32")
            m = T.alloc_fragment((HB,), "float32")
            m_prev = T.alloc_fragment((HB,), "float32")
            bm = T.alloc_fragment((HB,), "float32")
            rs = T.alloc_fragment((HB,), "float32")
            l = T.alloc_fragment((HB,), "float32")
            ix0 = T.alloc_local((BLK // 16,), "int32")
            ix1 = T.alloc_local((BLK // 16,), "int32")
            ready0 = T.alloc_barrier(256)
            ready1 = T.alloc_barrier(256)
            p_ready = T.alloc_barrier(128)
            p_free = T.alloc_barrier(256)
            l_ready = T.alloc_barrier(128)
            tx = T.get_thread_binding()
            t = bx // NHB
            h0 = (bx % NHB) * HB
            if tx < 128:
                T.copy(Q[t, h0:h0 + HB, 0:DH], ql)
                T.copy(Q[t, h0:h0 + HB, DH:D], qr)
                T.clear(l)
                T.fill(m, NEG)
                for i in T.serial(NPAIR):
                    score(ql, qr, kvl0, kvr0, ids0, ready0, 2 * i, i & 1, lg, m, m_prev, bm, rs, l, p_s, rs_s,
                          p_ready, p_free)
                    score(ql, qr, kvl1, kvr1, ids1, ready1, 2 * i + 1, i & 1, lg, m, m_prev, bm, rs, l, p_s, rs_s,
                          p_ready, p_free)
                for h in T.Parallel(HB):
                    bm[h] = T.if_then_else(m[h] == NEG, T.float32(0), m[h])
                    inv_s[h] = 1 / (l[h] + T.exp(SINK[h0 + h] - bm[h]))
                T.barrier_arrive(l_ready[0])
            elif tx < 256:
                accumulator(KV, IDX, O, BT[t], t, h0, tx - 128, 0, kvl0, kvl1, ids0, ids1, ready0, ready1, ix0, ix1,
                            acc_l, p_s, rs_s, inv_s, p_ready, p_free, l_ready, ql)
            else:
                accumulator(KV, IDX, O, BT[t], t, h0, tx - 256, 1, kvr0, kvr1, ids0, ids1, ready0, ready1, ix0, ix1,
                            acc_r, p_s, rs_s, inv_s, p_ready, p_free, l_ready, qr)

    return sparse_attn_ws
