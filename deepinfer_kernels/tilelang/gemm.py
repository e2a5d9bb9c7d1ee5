"""The FP8 block-scaled GEMM in TileLang (`fp8_gemm`), for decode- and prefill-sized M, on sm_90.

C[M, N] = A Wᵀ, A e4m3 [M, K] with per-row, per-128-K scales, W e4m3 [N, K] with 128x128 block scales. Each
program owns a 32 x 128 output tile (one weight-scale block wide) and walks K in 128-wide steps: the step's
tensor-core product is accumulated in its own fp32 fragment, cleared every step, then scaled by the row's
activation scale times the tile's weight scale into a second fp32 accumulator -- so the fp32 accumulation spans
the whole K, as DeepSeek's kernel.py fp8_gemm accumulates (and as our Triton kernel's default
DEEPINFER_FP8_GEMM=exact does). Tiles of 32 rows keep the MMAs warp-level (mma.sync), whose per-instruction
accumulation is fp32.

No `from __future__ import annotations`: TileLang evaluates the prim_func's annotations.
"""

import tilelang
import tilelang.language as T
import torch

from deepinfer.ops import ops
from deepinfer.ops.registry import REGISTRY, implement

from ._common import build, tl_dtype

BM, BN, BK = 32, 128, 128


def fp8_gemm_kernel(N: int, K: int, out_dt: str, stages: int = 3):
    """A [M, K] e4m3, AS [M, K/128] f32, W [N, K] e4m3, WS [N/128, K/128] f32 -> C [M, N] out_dt (M symbolic)."""
    M = T.symbolic("M")
    KB = K // BK
    NW = (N + 127) // 128

    @T.prim_func
    def fp8_gemm_k(A: T.Tensor((M, K), "float8_e4m3"), AS: T.Tensor((M, KB), "float32"),
                   W: T.Tensor((N, K), "float8_e4m3"), WS: T.Tensor((NW, KB), "float32"),
                   C: T.Tensor((M, N), out_dt)):
        with T.Kernel(T.ceildiv(N, BN), T.ceildiv(M, BM), threads=128) as (bx, by):
            a_t = T.alloc_shared((BM, BK), "float8_e4m3")
            w_t = T.alloc_shared((BN, BK), "float8_e4m3")
            scale = T.alloc_shared((BM,), "float32")
            part = T.alloc_fragment((BM, BN), "float32")
            acc = T.alloc_fragment((BM, BN), "float32")
            c_t = T.alloc_shared((BM, BN), out_dt)
            T.clear(acc)
            for kb in T.Pipelined(KB, num_stages=stages):
                T.copy(A[by * BM, kb * BK], a_t)
                T.copy(W[bx * BN, kb * BK], w_t)
                for i in T.Parallel(BM):
                    scale[i] = T.if_then_else(by * BM + i < M, AS[by * BM + i, kb], T.float32(0)) * WS[bx, kb]
                T.clear(part)
                T.gemm(a_t, w_t, part, transpose_B=True)
                for i, j in T.Parallel(BM, BN):
                    acc[i, j] += part[i, j] * scale[i]
            T.copy(acc, c_t)
            T.copy(c_t, C[by * BM, bx * BN])

    return fp8_gemm_k


@implement("fp8_gemm", "tilelang")
def fp8_gemm(a: torch.Tensor, a_s: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor,
             out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    M, K = a.shape
    N = w.size(0)
    ref = REGISTRY["fp8_gemm"].ref
    if K % BK or N % 16 or M == 0:
        if M:
            ops.runtime_fallback("fp8_gemm", f"the TileLang kernel takes K % 128 == 0 and N % 16 == 0, not "
                                             f"N {N}, K {K}")
        return ref(a, a_s, w, w_s, out_dtype)
    kern = build("fp8_gemm", (N, K, str(out_dtype)),
                 lambda: tilelang.compile(fp8_gemm_kernel(N, K, tl_dtype(out_dtype)), out_idx=[4]))
    if kern is None:
        return ref(a, a_s, w, w_s, out_dtype)
    return kern(a.contiguous(), a_s.float().contiguous(), w.contiguous(), w_s.float().contiguous())
