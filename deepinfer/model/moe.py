"""V4 MoE: sqrtsoftplus router (bias for selection only, hash table in the first layers), routed
clamped-SwiGLU experts weighted before their down projection, plus one shared expert."""

from __future__ import annotations

import torch

from deepinfer.config import ModelConfig
from deepinfer.debug.capture import tap
from deepinfer.model.weights import WeightSource
from deepinfer.ops import ops


class Expert:
    """SwiGLU FFN: w2(weight · swiglu(w1 x, w3 x)); the activation is computed in float32."""

    def __init__(self, W: WeightSource, prefix: str, limit: float):
        self.w1, self.w2, self.w3 = (W.linear(f"{prefix}w{i}") for i in (1, 2, 3))
        self.limit = limit

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        h = ops.swiglu(self.w1(x), self.w3(x), self.limit)
        if weight is not None:  # the official code scales before w2 (so w2's FP8 input sees it)
            h = weight * h
        return self.w2(h.to(x.dtype))


class MoE:
    """Routed experts + the shared expert for one layer."""

    def __init__(self, cfg: ModelConfig, W: WeightSource, prefix: str, hash_routed: bool):
        self.name = prefix.rstrip(".")
        self.topk, self.score_func, self.route_scale = cfg.n_activated_experts, cfg.score_func, cfg.route_scale
        self.gate_w = W.f32(prefix + "gate.weight")
        self.bias = None if hash_routed else W.f32(prefix + "gate.bias")
        self.tid2eid = W.raw(prefix + "gate.tid2eid").long() if hash_routed else None
        self.experts = [Expert(W, f"{prefix}experts.{e}.", cfg.swiglu_limit) for e in range(cfg.n_routed_experts)]
        self.shared = Expert(W, prefix + "shared_experts.", cfg.swiglu_limit)

    def __call__(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """x [B, S, D], input_ids [B, S] -> [B, S, D]."""
        shape = x.shape
        xt = x.reshape(-1, shape[-1])
        weights, idx, scores = ops.moe_route(xt, self.gate_w, self.bias, self.tid2eid, input_ids.reshape(-1),
                                             self.topk, self.score_func, self.route_scale)
        tap(self.name + ".router.scores", scores)
        tap(self.name + ".router.experts", idx)
        tap(self.name + ".router.weights", weights)
        y = torch.zeros(xt.shape, dtype=torch.float32, device=x.device)
        # Reference loop over the experts that received tokens (the kernels replace it).
        for e in torch.unique(idx).tolist():
            tok, k = torch.where(idx == e)
            y.index_add_(0, tok, self.experts[e](xt[tok], weights[tok, k, None]).float())
        y += self.shared(xt).float()
        return y.to(x.dtype).view(shape)
