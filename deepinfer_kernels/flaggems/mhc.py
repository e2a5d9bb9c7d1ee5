"""mHC through FlagGems' `flag_gems.fused.mhc`.

hc_pre: the mixes as the reference computes them (F.linear of the fp32 streams times the RMS rsqrt, PyTorch),
then `hc_split_sinkhorn(mixes, scale, base, hc_mult, iters, eps)` (pre = sigmoid + eps, post = 2 sigmoid,
comb = Sinkhorn(softmax(mix x scale + base)): our formulas, reciprocal-multiplied), then y = sum_j pre_j x_j in
PyTorch. FlagGems runs its kernel only at eps == 1e-6 (the value is hard-coded in it; any other eps silently runs
its own torch code), so another hc_eps falls back here, visibly.
Not used: FlagGems' fused `mhc_pre`, whose GEMM rounds the fp32 `fn` and the streams to bf16 (`_get_fn_bf16_cached`),
outside our fp32 contract for the mixes (hc_pre's fp32 tolerance is 1e-5).
hc_post: `mhc_post(x [N, D], residual [N, hc, D], post [N, hc], comb [N, hc, hc])`: new stream k = post_k x +
sum_j comb[j, k] residual_j in fp32, bf16 out: our contract for bf16 streams (no copy for contiguous ones; a
strided residual is made contiguous first, since mhc_post writes its empty_like(residual) output as contiguous).
hc_pre_quant / moe_combine_post: composed by the registry from these and the norm + act_quant / the PyTorch MoE sum
(`registry.compose` in this package's __init__).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.ops.registry import REGISTRY, implement

from ._common import cuda, fg, off_contract, run, why

_MOD = "flag_gems.fused.mhc"


@implement("hc_pre", "flaggems")
def hc_pre(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
           norm_eps: float, hc_eps: float, iters: int, side=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ref = REGISTRY["hc_pre"].ref
    B, S, hc, D = x.shape
    if B * S == 0:
        return ref(x, fn, scale, base, norm_eps, hc_eps, iters)
    mix = (2 + hc) * hc
    bad = ""
    if not cuda(x):
        bad = f"FlagGems kernels run on CUDA, not {x.device}"
    elif float(hc_eps) != 1e-6:
        bad = f"FlagGems' hc_split_sinkhorn kernel hard-codes eps 1e-6, not {hc_eps}"
    elif tuple(scale.shape) != (3,) or tuple(base.shape) != (mix,) or tuple(fn.shape) != (mix, hc * D):
        bad = f"mHC parameter shapes {tuple(fn.shape)}, {tuple(scale.shape)}, {tuple(base.shape)} for hc {hc}"
    m = None if bad else fg(_MOD, x.device)
    if m is None:
        return off_contract("hc_pre", bad or why(_MOD), ref, x, fn, scale, base, norm_eps, hc_eps, iters)
    def kernel():
        xf = x.flatten(2).float()
        mixes = F.linear(xf, fn.float()) * torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)
        pre, post, comb = m.hc_split_sinkhorn(mixes.contiguous(), scale.float().contiguous(),
                                              base.float().contiguous(), hc_mult=hc, sinkhorn_iters=int(iters),
                                              eps=1e-6)
        y = (pre.unsqueeze(-1) * x.float()).sum(dim=2)
        return y.to(x.dtype), post, comb

    return run("hc_pre", (hc, int(iters)), kernel, lambda: ref(x, fn, scale, base, norm_eps, hc_eps, iters))



@implement("hc_post", "flaggems")
def hc_post(x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    ref = REGISTRY["hc_post"].ref
    B, S, hc, D = residual.shape
    if B * S == 0:
        return ref(x, residual, post, comb)
    bad = ""
    if not cuda(x, residual):
        bad = f"FlagGems kernels run on CUDA, not {x.device}"
    elif x.dtype != torch.bfloat16 or residual.dtype != torch.bfloat16:
        bad = f"FlagGems' mhc_post takes bf16 streams, not {x.dtype} / {residual.dtype}"
    m = None if bad else fg(_MOD, x.device)
    if m is None:
        return off_contract("hc_post", bad or why(_MOD), ref, x, residual, post, comb)
    n = B * S
    # contiguous first: mhc_post allocates its output with empty_like(residual) (a strided residual gives a strided
    # output) but writes it as a contiguous [N, hc, D] (a copy only where the caller's streams are strided)
    return run("hc_post", (hc, D), lambda: m.mhc_post(
        x.reshape(n, D).contiguous(), residual.reshape(n, hc, D).contiguous(), post.float().reshape(n, hc).contiguous(),
        comb.float().reshape(n, hc, hc).contiguous()).view(B, S, hc, D), lambda: ref(x, residual, post, comb))
