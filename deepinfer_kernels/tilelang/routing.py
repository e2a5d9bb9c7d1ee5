"""MoE routing through DeepSeek's TileKernels (`tile_kernels.moe.moe_topk_gate_forward`, TileLang): sqrt-softplus
scores, the per-expert bias for selection only, a stable top-k (ties to the lower expert id), weights = the
unbiased scores of the chosen experts normalised to 1 and times the routed scaling factor -- our `moe_route`'s
contract. Hash layers pass their table's experts as fixed routing (`fix_routing_mask`), so the kernel gathers
and normalises their scores alike. The gate logits are F.linear of the fp32 activations in PyTorch, as model.py's
`Gate` computes them. Other score functions (softmax, sigmoid) run the reference, visibly."""

import torch
import torch.nn.functional as F

from deepinfer.ops import ops
from deepinfer.ops.registry import REGISTRY, implement


@implement("moe_route", "tilelang")
def moe_route(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor | None, tid2eid: torch.Tensor | None,
              input_ids: torch.Tensor, topk: int, score_func: str, route_scale: float):
    ref = REGISTRY["moe_route"].ref
    why = ""
    try:
        from tile_kernels.moe import moe_topk_gate_forward
    except ImportError as e:
        why = f"TileKernels is not importable ({type(e).__name__}: {e}; pip install -e '.[tilelang]')"
    if not why and score_func != "sqrtsoftplus":
        why = f"TileKernels' MoE gate computes sqrtsoftplus scores, not {score_func}"
    if why or x.size(0) == 0:
        if why:
            ops.runtime_fallback("moe_route", why)
        return ref(x, gate_w, bias, tid2eid, input_ids, topk, score_func, route_scale)
    T_ = x.size(0)
    logits = F.linear(x.float(), gate_w.float()).contiguous()
    scores = torch.empty_like(logits)
    kw = {}
    if tid2eid is not None:
        kw["unmapped_topk_idx"] = tid2eid[input_ids.reshape(-1)].long().contiguous()
        kw["fix_routing_mask"] = torch.ones(T_, dtype=torch.bool, device=x.device)
    elif bias is not None:
        kw["bias"] = bias.float().contiguous()
    idx, w = moe_topk_gate_forward(logits, topk, False, 0, float(route_scale), 0, scoring_func="sqrtsoftplus",
                                   scores=scores, **kw)
    return w, idx, scores
