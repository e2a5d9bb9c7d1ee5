"""Prefill path of the grouped expert GEMM for FP8 (e4m3, 128x128 block-scaled) experts: a TMA FP8 grouped GEMM.

At prefill every expert sees tens to hundreds of rows (4096 tokens x top-6 over 256 experts: ~96), so the
GEMMs are compute-bound. `_gg_fp8_tma_kernel` takes the aligned row blocks of `moe_align`, gathers the A
rows by pointer, loads the expert's W tiles through one TMA descriptor over the [E*N, K] weights, promotes
the tensor-core partial to fp32 once per 128-K block (max_num_imprecise_acc = 128, DeepGEMM's scheme; see
gemm.py) and multiplies in the A row scale and the 128x128 W block scale.

FP4 experts do not come here: their in-kernel FP4 -> bf16 decode (`moe_grouped._gg_fp4_kernel`) is exact for
every scale pattern and measured faster than an FP4 -> FP8 upcast into scratch followed by this GEMM (see
moe_grouped).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ._common import cdiv
from ._common import expert_block_tile, pdl, pdl_wait, tma_ok


@triton.jit
def _gg_fp8_tma_kernel(a_ptr, as_ptr, w_desc, ws_ptr, c_ptr, rows_ptr, bexp_ptr, P, N, K, KS_A, KS_W, NS_W,
                       BM: tl.constexpr, BN: tl.constexpr, TOPK: tl.constexpr = 1):
    """N tile pid0 x block pid1 (one expert's BM sorted rows), with the expert's [N, K] weights as rows
    e * N + n of the descriptor and its [N/128, K/128] block scales. TOPK: pair p reads A's row p // TOPK."""
    pdl_wait()
    # N tiles vary fastest: consecutive programs reuse the block's gathered A rows from L2
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    ex = tl.load(bexp_ptr + pid_m).to(tl.int64)
    if ex < 0:
        return
    rows, mr, rn, mn = expert_block_tile(rows_ptr, pid_m, pid_n, P, N, BM, BN)
    ar = rows // TOPK
    rk = tl.arange(0, 128)
    wrow = ex * N + pid_n * BN
    acc = tl.zeros([BM, BN], tl.float32)
    for kb in range(0, tl.cdiv(K, 128)):
        k = kb * 128 + rk
        a = tl.load(a_ptr + ar[:, None] * K + k[None, :], mask=mr[:, None] & (k[None, :] < K), other=0.0)
        w = w_desc.load([wrow.to(tl.int32), kb * 128])
        sa = tl.load(as_ptr + ar * KS_A + kb, mask=mr, other=0.0)
        sw = tl.load(ws_ptr + (ex * NS_W + rn // 128) * KS_W + kb, mask=mn, other=0.0)
        acc += tl.dot(a, w.T, max_num_imprecise_acc=128) * (sa[:, None] * sw[None, :])
    tl.store(c_ptr + rows[:, None] * N + rn[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=mr[:, None] & mn[None, :])


def usable(a: torch.Tensor, w: torch.Tensor, BM: int) -> bool:
    """Prefill-sized blocks (BM >= 64) on a GPU with TMA (or the interpreter), N a multiple of the 128-row
    W tile (a tile never reaches into the next expert), K a multiple of 128, W 16-byte aligned (a TMA
    descriptor's base)."""
    N = w.size(1)
    K = a.size(1)
    if BM < 64 or N % 128 or K % 128 or w.data_ptr() % 16:
        return False
    return tma_ok(a)


def fp8_grouped(a, a_s, w, w_s, c, rows, bexp, BM, topk: int = 1):
    """c [P, N] = the rows' experts applied: a [P / topk, K] e4m3 + a_s [P / topk, K/128] (row p of c reads a's
    row p // topk), w [E, N, K] e4m3 with w_s [E, N/128, K/128] block scales, rows / bexp from `moe_align` with
    block BM."""
    E, N, K = w.shape
    wd = TensorDescriptor.from_tensor(w.view(E * N, K), [128, 128])
    _gg_fp8_tma_kernel[(cdiv(N, 128), bexp.numel())](
        a, a_s, wd, w_s, c, rows, bexp, c.size(0), N, K, a_s.size(1), w_s.size(2), w_s.size(1),
        BM=BM, BN=128, TOPK=topk, num_warps=8, num_stages=4, **pdl())
    return c
