"""The warp-specialised form of TileLang's sparse attention with sink (`sparse_attn`), for 64-head blocks on sm_90.

The plain kernel (attention.py) gathers a block of kv rows, then multiplies, then gathers the next: the gather and
the tensor core take turns. Here three warpgroups of one program (one query token, 64 heads) overlap them:

* a prologue (every thread): the scorer starts Q's transfer by cp.async, then the token's K slot ids are copied to
  shared memory and listed, in order, the 64-slot blocks that hold a valid one. Only those blocks are gathered and
  computed. A block of -1 slots is an exact no-op of the online softmax (max unchanged, factor 1, p = 0), so
  skipping it changes no bit; the model's prefill writes whole such blocks (a short window and few compressed
  entries early in the prompt: 18 % of the blocks at 4096 tokens of a CSA layer, 35 % at 2048);
* the scorer (threads 0-127) waits for a stage, computes the block's logits Q Kᵀ over all of D, the running max
  and p = exp(logit - max) as the reference rounds them, writes p (operand dtype) and the rescale factor to
  shared memory, and goes on to the next block's Q Kᵀ;
* two accumulators (threads 128-255: the left half of D, 256-383: the right half) each rescale their half of the
  output by that factor and accumulate P V; then each gathers its half of the block two ahead into the stage it
  has just read, by `cp.async` (16 bytes a copy, 8 threads a row; an empty slot's copy reads nothing and writes
  zeros). The slot ids come from the prologue's copy, read into registers right after `p_ready`, where a sync
  already stands: TileLang's sync pass fences every shared read it finds among cp.async writes.

The scorer holds no output, so the tensor core runs one block's Q Kᵀ while the accumulators run the previous
block's P V. With half the output in the scorer and a separate producer warpgroup (the split of FlashMLA's sparse
prefill and TileLang's V3.2 sparse MLA, this kernel's first form) Q Kᵀ, softmax and P V sat on one warpgroup's
path block after block, clearly slower than this split at prefill (docs/perf-log.md, "The sparse attention's
scorer and accumulators"). A fourth warpgroup does not fit:
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

Shared memory at D = 512: Q 64 KB (reused for the output), two stages of 64 rows 128 KB, p 8 KB, the slot ids
4 bytes each (4.5 KB at V4-Pro's 1152).

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


SMEM_BYTES = 227 * 1024  # sm_90's shared memory a block can take


def smem_bytes(D: int, K: int) -> int:
    """Shared memory the kernel takes at head dim D and K slots: Q, two stages, p, the two per-head vectors, the slot
    ids and the block flags and list (1 KB for the barriers and alignment)."""
    nblk = -(-K // BLK)
    return 2 * HB * D + 2 * 2 * BLK * D + 2 * HB * BLK + 2 * 4 * HB + 4 * nblk * BLK + 2 * 4 * nblk + 1024


def ws_fits(H: int, D: int, K: int) -> bool:
    """Whether the warp-specialised form takes this shape: D splits into two halves of whole 64-element rows (an
    accumulator's 8 threads x 8 elements a row) whose 16-byte chunks divide the scorer's 128 threads (Q's copy:
    D 128, 256 or 512), every 64-slot block has a prologue thread (K <= 384 x 64), and it all fits the shared
    memory."""
    return (H > 0 and D % 128 == 0 and 128 % (D // 16) == 0 and -(-K // BLK) <= THREADS
            and smem_bytes(D, K) <= SMEM_BYTES)


def sparse_attn_ws_kernel(H: int, D: int, K: int, dt: str, scale: float):
    """Q [T, H, D], KV [B, N, D], SINK [H] f32, IDX [T, K] int32, BT [T] int32 (each token's batch) ->
    O [T, H, D] (T, B, N symbolic; H a multiple of 64, D of 128). One program per (token, 64-head block)."""
    Tn, Bn, N = T.symbolic("T"), T.symbolic("B"), T.symbolic("N")
    NHB = H // HB
    NBLK = (K + BLK - 1) // BLK
    NPAIR = (NBLK + 1) // 2  # the stages alternate: the k-th non-empty block is in stage k % 2
    NL = (NBLK * BLK + THREADS - 1) // THREADS  # slot ids each thread loads in the prologue
    DH = D // 2
    U = DH // 64  # 16-byte copies per thread per half-row
    QCR = DH // 8  # Q's load: threads a half-row (16 bytes each; ws_fits: QCR divides 128)
    QRP = 128 // QCR  # and half-rows a pass of the scorer's 128 threads
    assert ws_fits(H, D, K), (H, D, K)
    NEG = -T.infinity("float32")
    LOG2E = 1.4426950408889634  # exp(x) as exp2(x log2 e), the hardware's ex2 (as Triton's exp)

    @T.macro
    def slot_ids(ids_s, bl_s, px, k, ix):
        """This thread's 4 rows' slot ids of the k-th non-empty block, from the program's copy in shared memory, into
        registers ahead of the gather (TileLang's sync pass fences every shared read among cp.async writes)."""
        blk = bl_s[k]
        for r in T.unroll(BLK // 16):
            ix[r] = ids_s[blk * BLK + r * 16 + px // 8]

    @T.macro
    def gather(KV, b, px, kvh, ready, ix, off):
        """Half `off` of a block's kv rows (slot ids ix) into kvh; an empty slot's copy reads nothing and writes 16
        zero bytes."""
        for r in T.unroll(BLK // 16):
            for u in T.unroll(U):
                c = 64 * u + px % 8 * 8
                T.ptx_cp_async(T.access_ptr(kvh[r * 16 + px // 8, c], "w", 8),
                               T.access_ptr(KV[b, T.max(ix[r], 0), off + c], "r", 8), 8, predicate=ix[r] >= 0)
        T.cp_async_barrier_noinc(ready[0])

    @T.macro
    def score(ql, qr, kvl, kvr, ids_s, bl_s, ready, k, par, lg, m, m_prev, bm, rs, l, p_s, rs_s, p_ready, p_free):
        """The k-th non-empty block's logits and softmax; p and the rescale factor to shared memory."""
        T.barrier_wait(ready[0], par)
        blk = bl_s[k]
        for h, j in T.Parallel(HB, BLK):  # empty slots (and those past K, -1 in ids_s): -inf
            lg[h, j] = T.if_then_else(ids_s[blk * BLK + j] >= 0, T.float32(0), NEG)
        T.gemm(ql, kvl, lg, transpose_B=True)
        T.gemm(qr, kvr, lg, transpose_B=True)
        for h, j in T.Parallel(HB, BLK):
            lg[h, j] = lg[h, j] * T.float32(scale)
        online_softmax(lg, m, m_prev, bm, rs, l, HB, BLK, lambda x: T.exp2(x * T.float32(LOG2E)))
        if k > 0:
            T.barrier_wait(p_free[0], (k - 1) & 1)  # the accumulators done with the previous block's p and factor
        T.copy(lg, p_s)
        for h in T.Parallel(HB):
            rs_s[h] = rs[h]
        T.fence_proxy_async()  # p (written by threads) is read by the accumulators' wgmma (the async proxy)
        T.barrier_arrive(p_ready[0])

    @T.macro
    def accumulate(KV, b, px, kvh, ids_s, bl_s, nv, ready, k, ix, acc, p_s, rs_s, p_ready, p_free, off):
        """The k-th non-empty block's P V for this half of D, then this half of the (k + 2)-th one's rows into the
        stage just read."""
        T.barrier_wait(p_ready[0], k & 1)
        if k + 2 < nv:
            slot_ids(ids_s, bl_s, px, k + 2, ix)
        for h, d in T.Parallel(HB, DH):
            acc[h, d] *= rs_s[h]
        T.gemm(p_s, kvh, acc)
        if k + 2 < nv:  # the scorer read this stage before p_ready; the other half is the other group's
            gather(KV, b, px, kvh, ready, ix, off)
        T.barrier_arrive(p_free[0])

    @T.macro
    def accumulator(KV, O, b, t, h0, px, half, kvh0, kvh1, ids_s, bl_s, nv, ready0, ready1, ix, acc, p_s, rs_s,
                    inv_s, p_ready, p_free, l_ready, o_s):
        """One half of D: the first two blocks' rows, then P V block after block, then the output."""
        if nv > 0:
            slot_ids(ids_s, bl_s, px, 0, ix)
            gather(KV, b, px, kvh0, ready0, ix, half * DH)
        if nv > 1:
            slot_ids(ids_s, bl_s, px, 1, ix)
            gather(KV, b, px, kvh1, ready1, ix, half * DH)
        T.clear(acc)
        for i in T.serial(NPAIR):
            if 2 * i < nv:
                accumulate(KV, b, px, kvh0, ids_s, bl_s, nv, ready0, 2 * i, ix, acc, p_s, rs_s, p_ready, p_free,
                           half * DH)
            if 2 * i + 1 < nv:
                accumulate(KV, b, px, kvh1, ids_s, bl_s, nv, ready1, 2 * i + 1, ix, acc, p_s, rs_s, p_ready, p_free,
                           half * DH)
        T.barrier_wait(l_ready[0], 0)
        for h, d in T.Parallel(HB, DH):
            acc[h, d] = acc[h, d] * inv_s[h]
        T.copy(acc, o_s)  # o_s is ql / qr: the scorer's Q copy and its last Q Kᵀ were done before l_ready
        T.copy(o_s, O[t, h0:h0 + HB, half * DH:half * DH + DH])

    @T.macro
    def load_q(Q, t, h0, tx, ql, qr, q_ready):
        """The program's Q rows into ql / qr by cp.async (DH / 8 threads a half-row, 16 bytes each), completing on
        q_ready: their transfer overlaps the slot-id prologue and the first gathers."""
        for i in T.unroll(HB // QRP):
            T.ptx_cp_async(T.access_ptr(ql[i * QRP + tx // QCR, tx % QCR * 8], "w", 8),
                           T.access_ptr(Q[t, h0 + i * QRP + tx // QCR, tx % QCR * 8], "r", 8), 8)
            T.ptx_cp_async(T.access_ptr(qr[i * QRP + tx // QCR, tx % QCR * 8], "w", 8),
                           T.access_ptr(Q[t, h0 + i * QRP + tx // QCR, DH + tx % QCR * 8], "r", 8), 8)
        T.cp_async_barrier_noinc(q_ready[0])

    @T.macro
    def load_ids(IDX, t, tx, v):
        """This thread's share of the token's slot ids (-1 past K) into registers."""
        for j in T.unroll(NL):
            v[j] = T.if_then_else(j * THREADS + tx < K, IDX[t, T.min(j * THREADS + tx, K - 1)], -1)

    @T.macro
    def block_list(tx, v, ids_s, flag_s, bl_s, nb):
        """The token's slot ids (v, loaded by `load_ids`) into ids_s (-1 past K), and its non-empty 64-slot blocks, in
        order, into bl_s; nb[0]: their count. Every thread takes part (TileLang adds a fourth sync to the three
        here, after the Q copy's cp.async writes)."""
        if tx < NBLK:
            flag_s[tx] = 0
        T.sync_threads()
        for j in T.unroll(NL):
            if j * THREADS + tx < NBLK * BLK:
                ids_s[j * THREADS + tx] = v[j]
                if v[j] >= 0:  # every writer writes 1: the race is benign
                    flag_s[(j * THREADS + tx) // BLK] = 1
        T.sync_threads()
        nb[0] = 0
        nb[1] = 0
        for kb in T.unroll(NBLK):  # nb[1]: block tx's place in the list, the non-empty blocks before it
            f = flag_s[kb]
            nb[0] = nb[0] + f
            nb[1] = nb[1] + T.if_then_else(kb < tx, f, 0)
        if tx < NBLK:
            if flag_s[tx] != 0:
                bl_s[T.max(T.min(nb[1], NBLK - 1), 0)] = tx  # (bounded, so the sync pass sees it cannot alias flag_s)
        T.sync_threads()

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
            ids_s = T.alloc_shared((NBLK * BLK,), "int32")
            flag_s = T.alloc_shared((NBLK,), "int32")
            bl_s = T.alloc_shared((NBLK,), "int32")
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
            v = T.alloc_local((NL,), "int32")
            nb = T.alloc_local((2,), "int32")
            ix = T.alloc_local((BLK // 16,), "int32")
            ready0 = T.alloc_barrier(256)
            ready1 = T.alloc_barrier(256)
            p_ready = T.alloc_barrier(128)
            p_free = T.alloc_barrier(256)
            l_ready = T.alloc_barrier(128)
            q_ready = T.alloc_barrier(128)
            tx = T.get_thread_binding()
            t = bx // NHB
            h0 = (bx % NHB) * HB
            if tx < 128:
                load_q(Q, t, h0, tx, ql, qr, q_ready)
            load_ids(IDX, t, tx, v)
            block_list(tx, v, ids_s, flag_s, bl_s, nb)
            nv = nb[0]
            if tx < 128:
                T.barrier_wait(q_ready[0], 0)
                T.clear(l)
                T.fill(m, NEG)
                for i in T.serial(NPAIR):
                    if 2 * i < nv:
                        score(ql, qr, kvl0, kvr0, ids_s, bl_s, ready0, 2 * i, i & 1, lg, m, m_prev, bm, rs, l, p_s,
                              rs_s, p_ready, p_free)
                    if 2 * i + 1 < nv:
                        score(ql, qr, kvl1, kvr1, ids_s, bl_s, ready1, 2 * i + 1, i & 1, lg, m, m_prev, bm, rs, l,
                              p_s, rs_s, p_ready, p_free)
                for h in T.Parallel(HB):
                    bm[h] = T.if_then_else(m[h] == NEG, T.float32(0), m[h])
                    inv_s[h] = 1 / (l[h] + T.exp(SINK[h0 + h] - bm[h]))
                T.barrier_arrive(l_ready[0])
            elif tx < 256:
                accumulator(KV, O, BT[t], t, h0, tx % 128, 0, kvl0, kvl1, ids_s, bl_s, nv, ready0, ready1, ix, acc_l,
                            p_s, rs_s, inv_s, p_ready, p_free, l_ready, ql)
            else:
                accumulator(KV, O, BT[t], t, h0, tx % 128, 1, kvr0, kvr1, ids_s, bl_s, nv, ready0, ready1, ix, acc_r,
                            p_s, rs_s, inv_s, p_ready, p_free, l_ready, qr)

    return sparse_attn_ws
