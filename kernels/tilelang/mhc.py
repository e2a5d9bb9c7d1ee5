"""mHC post-mix from DeepSeek's TileKernels (`tile_kernels.mhc.mhc_post_fwd`, TileLang): its contract is ours
(new stream k = post_k x + sum_j comb[j, k] residual_j in fp32, bf16 out), so the TileLang backend calls it
rather than writing its own; it is A/B'd against the reference like every kernel here. TileKernels takes bf16
streams with a hidden size that is a multiple of 128; anything else runs the reference, visibly."""

import torch

from deepinfer.ops import ops
from deepinfer.ops.registry import REGISTRY, implement


def _tile_kernels_mhc():
    try:
        from tile_kernels import mhc
    except ImportError as e:
        return None, f"TileKernels is not importable ({type(e).__name__}: {e}; pip install -e '.[tilelang]')"
    return mhc, ""


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
