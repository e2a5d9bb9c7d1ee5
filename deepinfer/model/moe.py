"""V4 MoE: sqrtsoftplus router (bias for selection only, hash table in the first layers), routed
clamped-SwiGLU experts weighted before their down projection, plus one shared expert.

The routed part works on (token, expert) *pairs*: `compute_experts(x_rows [P, D], w [P], e [P])` runs
row p through local expert e[p] (e = -1 marks a padding row, output 0). Locally the pairs are every
token's top-k; with expert parallelism (`deepinfer.engine.distributed`) `dispatch` is replaced by an
all-to-all exchange that calls `compute_experts` on the rows a rank received for its own experts.
"""

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
    """Routed experts + the shared expert for one layer.

    `experts` holds this process's experts: ids `expert_offset .. expert_offset + len(experts) - 1`
    (all of them unless expert parallelism sharded the layer).
    """

    def __init__(self, cfg: ModelConfig, W: WeightSource, prefix: str, hash_routed: bool,
                 expert_range: tuple[int, int] | None = None):
        self.name = prefix.rstrip(".")
        self.topk, self.score_func, self.route_scale = cfg.n_activated_experts, cfg.score_func, cfg.route_scale
        self.n_experts = cfg.n_routed_experts
        self.gate_w = W.f32(prefix + "gate.weight")
        self.bias = None if hash_routed else W.f32(prefix + "gate.bias")
        self.tid2eid = W.raw(prefix + "gate.tid2eid").long() if hash_routed else None
        lo, hi = expert_range or (0, cfg.n_routed_experts)
        self.expert_offset = lo
        self.experts = [Expert(W, f"{prefix}experts.{e}.", cfg.swiglu_limit) for e in range(lo, hi)]
        self.shared = Expert(W, prefix + "shared_experts.", cfg.swiglu_limit)
        self.dispatch = self.dispatch_local

    def __call__(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """x [B, S, D], input_ids [B, S] -> [B, S, D]."""
        shape = x.shape
        xt = x.reshape(-1, shape[-1])
        weights, idx, scores = ops.moe_route(xt, self.gate_w, self.bias, self.tid2eid, input_ids.reshape(-1),
                                             self.topk, self.score_func, self.route_scale)
        tap(self.name + ".router.scores", scores)
        tap(self.name + ".router.experts", idx)
        tap(self.name + ".router.weights", weights)
        y = self.dispatch(xt, weights, idx)  # [T, D] float32
        y = y + self.shared(xt).float()
        return y.to(x.dtype).view(shape)

    def dispatch_local(self, xt: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """All experts are local: pairs = every token's top-k. -> [T, D] float32 (summed over k)."""
        T, k = idx.shape
        rows = xt.repeat_interleave(k, dim=0)
        out = self.compute_experts(rows, weights.reshape(-1), idx.reshape(-1) - self.expert_offset)
        return out.view(T, k, -1).sum(1)

    def compute_experts(self, x_rows: torch.Tensor, w: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """Row p through local expert e[p], scaled by w[p] before w2; e = -1 rows give 0.

        x_rows [P, D] compute dtype, w [P] f32, e [P] int64 (local ids) -> [P, D] float32.
        Reference loop over the experts present (host sync; the kernels replace it).
        """
        out = torch.zeros(x_rows.shape, dtype=torch.float32, device=x_rows.device)
        for j in torch.unique(e).tolist():
            if j < 0:
                continue
            (p,) = torch.where(e == j)
            out[p] = self.experts[j](x_rows[p], w[p, None]).float()
        return out
