"""mHC pre- and post-mix from DeepSeek's TileKernels (`tile_kernels.mhc`, TileLang), whose contracts are ours, so
the TileLang backend calls them rather than writing its own; they are A/B'd against the reference like every
kernel here. TileKernels takes bf16 streams with a hidden size that is a multiple of 128 (the post-mix) or of 64
(the pre-mix); anything else runs the reference, visibly.

hc_pre: the mixes as model.py's `Block.hc_pre` computes them (F.linear of the fp32 streams times the RMS rsqrt, in
PyTorch: DeepSeek's own code does not run this product in TileLang either), then TileKernels'
`mhc_pre_split_mixes_fwd` (pre = sigmoid + eps, post = 2 sigmoid, comb = mix x scale + base), `mhc_sinkhorn_fwd`
(softmax + eps, column then row/column normalisation, each + eps: `tile_kernels.torch.mhc.sinkhorn_normalize_ref`
is our reference's Sinkhorn line for line) and `mhc_pre_apply_mix_fwd` (y = sum_j pre_j x_j in fp32, bf16 out).
hc_post: `mhc_post_fwd` (new stream k = post_k x + sum_j comb[j, k] residual_j in fp32, bf16 out).
"""

import torch
import torch.nn.functional as F

from deepinfer.ops import ops
from deepinfer.ops.registry import REGISTRY, implement



def _tile_kernels_mhc():
    try:
        from tile_kernels import mhc
    except ImportError as e:
        return None, f"TileKernels is not importable ({type(e).__name__}: {e}; pip install -e '.[tilelang]')"
    return mhc, ""


@implement("hc_pre", "tilelang")
def hc_pre(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
           norm_eps: float, hc_eps: float, iters: int, side=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, S, hc, D = x.shape
    mhc, why = _tile_kernels_mhc()
    if mhc is not None and (x.dtype != torch.bfloat16 or D % 64):
        why = f"TileKernels' mhc_pre takes bf16 streams with hidden % 64 == 0, not {x.dtype}, {D}"
    if why or B * S == 0:
        if why:
            ops.runtime_fallback("hc_pre", why)
        return REGISTRY["hc_pre"].ref(x, fn, scale, base, norm_eps, hc_eps, iters)
    n = B * S
    xf = x.reshape(n, hc * D).float()
    mixes = (F.linear(xf, fn.float()) * torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)).contiguous()
    pre = torch.empty(n, hc, dtype=torch.float32, device=x.device)
    post = torch.empty(n, hc, dtype=torch.float32, device=x.device)
    comb = torch.empty(n, hc * hc, dtype=torch.float32, device=x.device)
    mhc.mhc_pre_split_mixes_fwd(mixes, scale.float().contiguous(), base.float().contiguous(), pre, post, comb,
                                2.0, float(hc_eps))
    comb_out = torch.empty(n, hc, hc, dtype=torch.float32, device=x.device)
    mhc.mhc_sinkhorn_fwd(comb.view(n, hc, hc), comb_out, int(iters), float(hc_eps))
    y = torch.empty(n, D, dtype=torch.bfloat16, device=x.device)
    mhc.mhc_pre_apply_mix_fwd(x.reshape(n, hc, D).contiguous(), pre, y)
    return y.view(B, S, D), post.view(B, S, hc), comb_out.view(B, S, hc, hc)



@implement("hc_post", "tilelang")
def hc_post(x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    B, S, hc, D = residual.shape
    ref = REGISTRY["hc_post"].ref
    mhc, why = _tile_kernels_mhc()
    if mhc is not None and (x.dtype != torch.bfloat16 or residual.dtype != torch.bfloat16 or D % 128):
        why = f"TileKernels' mhc_post takes bf16 streams with hidden % 128 == 0, not {x.dtype} / {residual.dtype}, {D}"
    if why or B * S == 0:
        if why:
            ops.runtime_fallback("hc_post", why)
        return ref(x, residual, post, comb)
    return mhc.mhc_post_fwd(x.contiguous(), residual.contiguous(), post.float().unsqueeze(-1).contiguous(),
                            comb.float().contiguous())
