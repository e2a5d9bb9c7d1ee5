"""The warp-specialised form of TileLang's sparse attention with sink (`sparse_attn`), for 64-head blocks on sm_90.

The plain kernel (attention.py) gathers a block of kv rows, then multiplies, then gathers the next: the gather and
the tensor core take turns. Here three warpgroups of one program (one query token, 64 heads) overlap them, the
split FlashMLA's sparse prefill and TileLang's DeepSeek-V3.2 sparse MLA use:

* the producer (threads 256-383) gathers the token's kv rows into two alternating shared stages with `cp.async`
  (16 bytes a copy, 8 threads a row; an empty slot's copy reads nothing and writes zeros);
* consumer 0 (threads 0-127) waits for a stage, computes the block's logits Q Kᵀ over both halves of D, the
  running max and p = exp(logit - max) as the reference rounds them, writes p (operand dtype) and the rescale
  factor to shared memory, and accumulates P V for the left half of D (the producer also copies the block's 64
  slot ids, for consumer 0's mask);
* consumer 1 (threads 128-255) rescales its accumulator by the same factor and accumulates P V for the right half.

A stage is released when both consumers' P V on it is done (`free`, 256 arrivals), so the producer fills stage
s ^ 1 while the consumers work on s. Numerics are the plain kernel's and the reference's (`sparse_attn`): blocks
of 64 slots in idx order, logits (q . kv) * scale in fp32, empty slots -inf, the running max over the logits
only, p summed in fp32 and cast to the operands' dtype for P V, the sink joining the denominator last, 0 for a
token with no valid slot. One difference: the block's exponentials are exp2(x log2 e) on the hardware's ex2 (as
Triton's tl.exp), a few fp32 ulp from the expf the plain kernel calls.
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
def online_softmax(lg, acc, m, m_prev, bm, rs, l, H: int, BLK: int, D: int, exp):
    """One block of the reference's online softmax, in place: logits lg [H, BLK] (empty slots -inf) -> p = exp(lg -
    max); the running max m, the denominator l and the accumulator acc [H, D] rescaled by rs = exp(m_prev - m).
    m_prev and bm are scratch. `exp` is the exponential the kernel rounds with (a Python callable of a TIR value)."""
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
    for h, d in T.Parallel(H, D):
        acc[h, d] *= rs[h]


def ws_fits(H: int, D: int) -> bool:
    """Whether the warp-specialised form takes this shape: D splits into two halves of whole 64-element rows
    (the producer's 8 threads x 8 elements a row) and fits the shared memory (D <= 512)."""
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
    def produce(KV, IDX, BT, t, px, kvl, kvr, ids, ready, free, kb, par, ix):
        for r in T.unroll(BLK // 16):  # this thread's rows' indices, loaded before the wait that may hide them
            ix[r] = T.if_then_else(kb * BLK + r * 16 + px // 8 < K,
                                   IDX[t // NHB, T.min(kb * BLK + r * 16 + px // 8, K - 1)], -1)
        T.barrier_wait(free[0], par ^ 1)  # both consumers done with this stage's previous block
        if px < BLK:  # the block's slot ids for consumer 0's mask (past K: 0, which the mask tells by position)
            T.ptx_cp_async(T.access_ptr(ids[px], "w", 1),
                           T.access_ptr(IDX[t // NHB, T.min(kb * BLK + px, K - 1)], "r", 1), 1,
                           predicate=kb * BLK + px < K)
        for r in T.unroll(BLK // 16):
            for u in T.unroll(U):  # an empty slot's copy reads nothing and writes 16 zero bytes
                c = 64 * u + px % 8 * 8
                T.ptx_cp_async(T.access_ptr(kvl[r * 16 + px // 8, c], "w", 8),
                               T.access_ptr(KV[BT[t // NHB], T.max(ix[r], 0), c], "r", 8), 8, predicate=ix[r] >= 0)
                T.ptx_cp_async(T.access_ptr(kvr[r * 16 + px // 8, c], "w", 8),
                               T.access_ptr(KV[BT[t // NHB], T.max(ix[r], 0), DH + c], "r", 8), 8,
                               predicate=ix[r] >= 0)
        T.cp_async_barrier_noinc(ready[0])

    @T.macro
    def score(ql, qr, kvl, kvr, ids, ready, free, kb, par, lg, acc, m, m_prev, bm, rs, l, p_s, rs_s,
              p_ready, p_free):
        T.barrier_wait(ready[0], par)
        for h, j in T.Parallel(HB, BLK):  # empty slots and those past K: -inf
            lg[h, j] = T.if_then_else((kb * BLK + j < K) & (ids[j] >= 0), T.float32(0), NEG)
        T.gemm(ql, kvl, lg, transpose_B=True)
        T.gemm(qr, kvr, lg, transpose_B=True)
        for h, j in T.Parallel(HB, BLK):
            lg[h, j] = lg[h, j] * T.float32(scale)
        online_softmax(lg, acc, m, m_prev, bm, rs, l, HB, BLK, DH, lambda x: T.exp2(x * T.float32(LOG2E)))
        if kb > 0:
            T.barrier_wait(p_free[0], (kb - 1) & 1)  # consumer 1 done with the previous block's p and factor
        T.copy(lg, p_s)
        for h in T.Parallel(HB):
            rs_s[h] = rs[h]
        T.gemm(p_s, kvl, acc)
        T.barrier_arrive(p_ready[0])
        T.barrier_arrive(free[0])

    @T.macro
    def accumulate(kvr, free, kb, acc, p_s, rs_s, p_ready, p_free):
        T.barrier_wait(p_ready[0], kb & 1)
        for h, d in T.Parallel(HB, DH):
            acc[h, d] *= rs_s[h]
        T.gemm(p_s, kvr, acc)
        T.barrier_arrive(free[0])
        T.barrier_arrive(p_free[0])

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
            l_s = T.alloc_shared((HB,), "float32")
            lg = T.alloc_fragment((HB, BLK), "float32")
            acc_l = T.alloc_fragment((HB, DH), "float32")
            acc_r = T.alloc_fragment((HB, DH), "float32")
            m = T.alloc_fragment((HB,), "float32")
            m_prev = T.alloc_fragment((HB,), "float32")
            bm = T.alloc_fragment((HB,), "float32")
            rs = T.alloc_fragment((HB,), "float32")
            l = T.alloc_fragment((HB,), "float32")
            ix = T.alloc_local((BLK // 16,), "int32")
            ready0 = T.alloc_barrier(128)
            ready1 = T.alloc_barrier(128)
            free0 = T.alloc_barrier(256)
            free1 = T.alloc_barrier(256)
            p_ready = T.alloc_barrier(128)
            p_free = T.alloc_barrier(128)
            l_ready = T.alloc_barrier(128)
            tx = T.get_thread_binding()
            h0 = (bx % NHB) * HB
            if tx < 128:
                T.set_max_nreg(240, 1)
                T.copy(Q[bx // NHB, h0:h0 + HB, 0:DH], ql)
                T.copy(Q[bx // NHB, h0:h0 + HB, DH:D], qr)
                T.clear(acc_l)
                T.clear(l)
                T.fill(m, NEG)
                for i in T.serial(NPAIR):
                    score(ql, qr, kvl0, kvr0, ids0, ready0, free0, 2 * i, i & 1, lg, acc_l, m, m_prev, bm, rs,
                          l, p_s, rs_s, p_ready, p_free)
                    score(ql, qr, kvl1, kvr1, ids1, ready1, free1, 2 * i + 1, i & 1, lg, acc_l, m, m_prev, bm,
                          rs, l, p_s, rs_s, p_ready, p_free)
                for h in T.Parallel(HB):
                    bm[h] = T.if_then_else(m[h] == NEG, T.float32(0), m[h])
                    l[h] = l[h] + T.exp(SINK[h0 + h] - bm[h])
                    l_s[h] = l[h]
                T.barrier_arrive(l_ready[0])
                for h, d in T.Parallel(HB, DH):
                    acc_l[h, d] = acc_l[h, d] / l[h]
                T.copy(acc_l, ql)  # Q's last reader was this warpgroup's last Q Kᵀ
                T.copy(ql, O[bx // NHB, h0:h0 + HB, 0:DH])
            elif tx < 256:
                T.set_max_nreg(168, 1)
                T.clear(acc_r)
                for i in T.serial(NPAIR):
                    accumulate(kvr0, free0, 2 * i, acc_r, p_s, rs_s, p_ready, p_free)
                    accumulate(kvr1, free1, 2 * i + 1, acc_r, p_s, rs_s, p_ready, p_free)
                T.barrier_wait(l_ready[0], 0)
                for h, d in T.Parallel(HB, DH):
                    acc_r[h, d] = acc_r[h, d] / l_s[h]
                T.copy(acc_r, qr)  # consumer 0's last Q Kᵀ came before the last p this warpgroup waited for
                T.copy(qr, O[bx // NHB, h0:h0 + HB, DH:D])
            else:
                T.set_max_nreg(80, 0)  # 240 + 168 + 80 registers x 128 threads: the SM's 64 K
                for i in T.serial(NPAIR):
                    produce(KV, IDX, BT, bx, tx - 256, kvl0, kvr0, ids0, ready0, free0, 2 * i, i & 1, ix)
                    produce(KV, IDX, BT, bx, tx - 256, kvl1, kvr1, ids1, ready1, free1, 2 * i + 1, i & 1, ix)

    return sparse_attn_ws
