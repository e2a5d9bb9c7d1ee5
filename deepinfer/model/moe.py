"""V4 MoE: sqrtsoftplus router (bias for selection only, hash table in the first layers), routed
clamped-SwiGLU experts weighted before their down projection, plus one shared expert.

The routed part works on (token, expert) *pairs*: `compute_experts(x_rows [P, D], w [P], e [P])` runs
row p through local expert e[p] (e = -1 marks a padding row, output 0). Locally the pairs are every
token's top-k; with expert parallelism (`deepinfer.engine.distributed`) `dispatch` is replaced by an
all-to-all exchange that calls `compute_experts` on the rows a rank received for its own experts.
Either way `dispatch` hands back each token's routed rows ([T, k, D], or [T, 1, D] already summed) and
`ops.moe_combine` adds them and the shared expert's row in float32 (one launch). Locally, with FP8 / FP4
experts and the shared expert's act_quant at hand (official numerics), the pairs' w1|w3 input is those
quantised rows repeated (`RoutedExperts.run`), the same bytes as quantising the repeated rows.
"""

from __future__ import annotations

import torch

from deepinfer.capture import tap
from deepinfer.config import ModelConfig
from deepinfer.model.branch import fork
from deepinfer.model.weights import Linear, WeightSource
from deepinfer.ops import ops
from deepinfer.ops.routing import same_routing
from deepinfer.quant.formats import float_to_e8m0


class Expert:
    """SwiGLU FFN: w2(weight · swiglu(w1 x, w3 x)); the activation is computed in float32."""

    def __init__(self, W: WeightSource, prefix: str, limit: float):
        self.w1, self.w2, self.w3 = (W.linear(f"{prefix}w{i}") for i in (1, 2, 3))
        self.limit = limit
        # w1|w3 stacked (the shared expert): one GEMM for both; w1 / w3 stay as views of its rows
        self.w13 = Linear.stacked([self.w1, self.w3])
        if self.w13 is not None:
            I = self.w1.out_features
            self.w1, self.w3 = self.w13.rows(0, I), self.w13.rows(I, 2 * I)

    @classmethod
    def from_linears(cls, w1: Linear, w2: Linear, w3: Linear, limit: float) -> "Expert":
        ex = cls.__new__(cls)
        ex.w1, ex.w2, ex.w3, ex.limit, ex.w13 = w1, w2, w3, limit, None
        return ex

    def _gate_up(self, x: torch.Tensor, xq: tuple | None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.w13 is None:
            return self.w1(x, xq), self.w3(x, xq)
        h13 = self.w13(x, xq)
        I = self.w1.out_features
        return h13[..., :I], h13[..., I:]  # swiglu reads the halves by row stride

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | None = None, xq: tuple | None = None) -> torch.Tensor:
        """x [T, D] (xq: its act_quant, if the caller has it) -> [T, D]."""
        if weight is None and self.w2.fmt != "float":  # the activation and w2's act_quant in one kernel
            return self.w2.quantised(*ops.swiglu_quant(*self._gate_up(x, xq), self.limit, out_dtype=x.dtype),
                                     x.dtype)
        if weight is None:  # swiglu casts for w2 itself
            return self.w2(ops.swiglu(*self._gate_up(x, xq), self.limit, out_dtype=x.dtype))
        h = ops.swiglu(*self._gate_up(x, xq), self.limit)
        return self.w2((weight * h).to(x.dtype))  # the official code scales before w2 (its FP8 input sees it)


class StackedLinear:
    """One matrix of every local expert, stacked: `Linear`'s three forms with a leading expert dim --
    weight [E, N, K] (float / fp8) or [E, N, K/2] int8 (fp4); scale [E, ceil(N/128), ceil(K/128)] f32
    (fp8), [E, N, K/32] raw ue8m0 bytes uint8 (fp4: a quarter of the f32 bytes a decode step streams)
    or None (float).

    `parts` names, per expert, the checkpoint matrices concatenated along N: `[w1, w3]` makes the
    gate and up projections one [E, 2I, K] matrix, so one grouped GEMM (one routing sort, twice the
    programs per launch) computes both.
    """

    __slots__ = ("weight", "scale", "fmt")

    def __init__(self, W: WeightSource, prefixes: list[list[str]]):
        self.weight = self.scale = None
        self.fmt = ""
        E = len(prefixes)
        for j, parts in enumerate(prefixes):  # copy each expert in, then drop it: no second full copy
            n0 = 0
            for prefix in parts:
                lin = W.linear(prefix)
                if self.weight is None:
                    self.fmt = lin.fmt
                    shape = (E, lin.weight.size(0) * len(parts), lin.weight.size(1))
                    self.weight = torch.empty(shape, dtype=lin.weight.dtype, device=lin.weight.device)
                    if lin.scale is not None:
                        sdt = torch.uint8 if lin.fmt == "fp4" else lin.scale.dtype
                        sshape = (E, lin.scale.size(0) * len(parts), lin.scale.size(1))
                        self.scale = torch.empty(sshape, dtype=sdt, device=lin.scale.device)
                n = lin.weight.size(0)
                if lin.fmt != self.fmt or n0 + n > self.weight.size(1) or lin.weight.shape[1:] != self.weight.shape[2:]:
                    raise ValueError(f"{prefix}: {lin.fmt} {tuple(lin.weight.shape)} differs from the layer's other "
                                     f"experts ({self.fmt} {tuple(self.weight.shape[1:])} over {len(parts)} parts)")
                self.weight[j, n0:n0 + n].copy_(lin.weight)
                if self.scale is not None:
                    if self.fmt == "fp4":
                        try:
                            self.scale[j, n0:n0 + n].copy_(float_to_e8m0(lin.scale))
                        except ValueError as e:
                            raise ValueError(f"{prefix}.scale: {e}") from None
                    else:  # fp8: [ceil(N/128)] scale rows per part (N is a multiple of 128 when parts > 1)
                        r = lin.scale.size(0)
                        self.scale[j, (n0 // n) * r:(n0 // n + 1) * r].copy_(lin.scale)
                n0 += n
                del lin

    def __getitem__(self, j: int) -> Linear:
        """Expert j's matrix as a `Linear` over views of the stacks (no copy; FP4 scales stay bytes)."""
        return Linear(self.weight[j], None if self.scale is None else self.scale[j], self.fmt)

    def rows(self, j: int, lo: int, hi: int) -> Linear:
        """Rows lo:hi (one part) of expert j's matrix as a `Linear` over views (no copy)."""
        return self[j].rows(lo, hi)

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The GEMM input as `Linear` feeds it: act_quant per 128 for FP8/FP4 weights, x as is for float."""
        return (x, None) if self.fmt == "float" else ops.act_quant(x, 128)

    def __call__(self, a: tuple, e: torch.Tensor, out_dtype: torch.dtype, topk: int = 1) -> torch.Tensor:
        """Row p of the (quantised) input through expert e[p]'s matrix: -> [P, N] out_dtype (e = -1: 0).
        a: (x, None) for float weights, (q, s) as act_quant gives it, or (q, s, its bf16 split form) from a
        producer that wrote that too (`swiglu_quant(split=True)`; FP4 weights read it). topk: a holds one row
        per token for its topk consecutive pairs (row p reads a[p // topk]; `grouped_gemm`'s topk)."""
        kw = {"topk": topk} if topk != 1 else {}
        return ops.grouped_gemm(a[0], a[1], e, self.weight, self.scale, out_dtype=out_dtype,
                                a_split=a[2] if len(a) > 2 else None, **kw)


class RoutedExperts:
    """This process's routed experts as stacked weights, run on (row, expert) pairs with two
    `grouped_gemm`s (w1|w3 concatenated, then w2): no host sync, no per-expert launches (CUDA-graph
    capturable with a backend whose grouped_gemm is sync-free, e.g. Triton). `experts[j]` is expert j
    as an `Expert` over views of the stacks (for inspection and the per-expert reference)."""

    def __init__(self, W: WeightSource, prefix: str, ids: range, limit: float):
        self.limit = limit
        self.n = len(ids)
        names = [(f"{prefix}experts.{e}.w1", f"{prefix}experts.{e}.w3") for e in ids]
        w1 = W.state[names[0][0] + ".weight"] if self.n else None  # shape and storage format only
        self.inter = w1.size(0) if w1 is not None else 0
        fp8 = w1 is not None and w1.dtype == torch.float8_e4m3fn and W.numerics.official
        # FP8 block scales cover 128 rows: w1|w3 concatenate only if the seam falls on a block edge
        self.fused = not fp8 or self.inter % 128 == 0
        if self.fused:
            self.w13 = StackedLinear(W, [list(n) for n in names])
        else:
            self.w1, self.w3 = (StackedLinear(W, [[n[i]] for n in names]) for i in (0, 1))
        self.w2 = StackedLinear(W, [[f"{prefix}experts.{e}.w2"] for e in ids])

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, j: int) -> Expert:
        if not -self.n <= j < self.n:
            raise IndexError(j)
        j %= self.n
        if not self.fused:
            return Expert.from_linears(self.w1[j], self.w2[j], self.w3[j], self.limit)
        I = self.inter
        return Expert.from_linears(self.w13.rows(j, 0, I), self.w2[j], self.w13.rows(j, I, 2 * I), self.limit)

    def __iter__(self):
        return (self[j] for j in range(self.n))

    def __call__(self, x_rows: torch.Tensor, w: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """x_rows [P, D], w [P] f32, e [P] int64 (local ids, -1 = padding) -> [P, D] in x_rows' dtype.

        Per row exactly `Expert.__call__`: act_quant once for w1 and w3 (both quantise the same input),
        clamped SwiGLU in f32, the routing weight applied before w2, cast to x's dtype, w2 (out: x's dtype).
        """
        return self.run(self.w13.quantize_input(x_rows) if self.fused else self.w1.quantize_input(x_rows),
                        w, e, x_rows.dtype)

    @property
    def quantised_input(self) -> bool:
        """w1 / w3 take act_quant(x, 128) (FP8 / FP4 experts), so a caller holding it can pass it to `run`."""
        return self.input_fmt != "float"

    @property
    def input_fmt(self) -> str:
        """The storage format of w1 / w3 ("fp8", "fp4", "float"; "" with no local experts)."""
        return (self.w13 if self.fused else self.w1).fmt

    def run(self, a: tuple[torch.Tensor, torch.Tensor | None], w: torch.Tensor, e: torch.Tensor,
            dt: torch.dtype, topk: int = 1, every_row_local: bool = False) -> torch.Tensor:
        """`__call__` from the rows' w1 / w3 input as `quantize_input` gives it (a [P, D] [+ scales], or with topk
        > 1 one row per token for its topk consecutive pairs: [P / topk, D]) -> [P, D] dt. The GEMMs read e
        unchanged (`same_routing`: a backend may sort the pairs once for all of them). every_row_local: every
        id in e is one of these experts (no -1 rows), so no output row needs zeroing."""
        with same_routing(e, every_row_local):
            return self._run(a, w, e, dt, topk)

    def _run(self, a, w: torch.Tensor, e: torch.Tensor, dt: torch.dtype, topk: int) -> torch.Tensor:
        if self.fused:
            h13 = self.w13(a, e, dt, topk)
            h1, h3 = h13[:, :self.inter], h13[:, self.inter:]
        else:
            h1, h3 = self.w1(a, e, dt, topk), self.w3(a, e, dt, topk)
        if self.w2.fmt != "float" and self.fused:  # weighted before w2, as the official code; the SwiGLU and w2's
            # act_quant in one op with w2 (a kernel may compute them as it loads A: no launch between the GEMMs)
            return ops.swiglu_grouped_gemm(h13, self.limit, w, e, self.w2.weight, self.w2.scale, out_dtype=dt)
        if self.w2.fmt != "float":  # w2's act_quant in the SwiGLU's kernel (and for FP4 experts the bf16 form
            # their GEMM reads: no conversion launch before it)
            return self.w2(ops.swiglu_quant(h1, h3, self.limit, weight=w, out_dtype=dt, split=self.w2.fmt == "fp4"),
                           e, dt)
        return self.w2((ops.swiglu(h1, h3, self.limit, weight=w, out_dtype=dt), None), e, dt)


class MoE:
    """Routed experts + the shared expert for one layer.

    `experts` holds this process's experts: ids `expert_offset .. expert_offset + len(experts) - 1`
    (all of them unless expert parallelism sharded the layer), each matrix stacked over the experts
    (`RoutedExperts`); `experts[j]` is local expert j as an `Expert` over views of the stacks.
    """

    def __init__(self, cfg: ModelConfig, W: WeightSource, prefix: str, hash_routed: bool,
                 expert_range: tuple[int, int] | None = None):
        self.name = prefix.rstrip(".")
        self.topk, self.score_func, self.route_scale = cfg.n_activated_experts, cfg.score_func, cfg.route_scale
        self.n_experts = cfg.n_routed_experts
        self.gate_w = W.f32(prefix + "gate.weight")
        self.bias = None if hash_routed else W.f32(prefix + "gate.bias")
        self.tid2eid = W.raw(prefix + "gate.tid2eid").long() if hash_routed else None
        if self.tid2eid is not None and self.tid2eid.numel() and not (
                0 <= int(self.tid2eid.min()) and int(self.tid2eid.max()) < self.n_experts):
            raise ValueError(f"{prefix}gate.tid2eid routes to experts {int(self.tid2eid.min())}.."
                             f"{int(self.tid2eid.max())}, outside the model's 0..{self.n_experts - 1}")
        lo, hi = expert_range or (0, cfg.n_routed_experts)
        self.expert_offset = lo
        self.experts = RoutedExperts(W, prefix, range(lo, hi), cfg.swiglu_limit)
        # the shared expert's clamp is a release choice: DeepSeek's initial release builds it without swiglu_limit
        # (`Numerics.shared_clamp`; limit 0: no clamp)
        self.shared = Expert(W, prefix + "shared_experts.", cfg.swiglu_limit if W.numerics.shared_clamp else 0.0)
        self.dispatch = self.dispatch_local

    def __call__(self, x: torch.Tensor, input_ids: torch.Tensor, xq: tuple | None = None) -> torch.Tensor:
        """x [B, S, D], input_ids [B, S] (xq: x's act_quant, for the shared expert) -> [B, S, D]: `parts`, then
        their sum in float32 (`Block` fuses the sum into the mHC post-mix instead)."""
        routed, shared = self.parts(x, input_ids, xq)
        return ops.moe_combine(routed, shared, x.dtype).view(x.shape)

    def parts(self, x: torch.Tensor, input_ids: torch.Tensor, xq: tuple | None = None, decode: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The shared expert, the routing, the routed experts: x [B, S, D] -> (routed [T, k, D] (or [T, 1, D],
        expert parallelism), shared [T, D]), T = B * S. decode: the shared expert on a lane beside the routed
        ones (`deepinfer.model.branch.fork`: a side stream when the runner supplies one)."""
        xt = x.reshape(-1, x.size(-1))
        br = fork(xt, on=decode, lane="shared_expert")
        with br:
            shared = self.shared_expert(xt, xq)
        routed = self.routed(xt, input_ids, xq)
        return routed, br.join(shared)

    def shared_expert(self, xt: torch.Tensor, xq: tuple | None = None) -> torch.Tensor:
        """xt [T, D] (xq: its act_quant) -> the shared expert's rows [T, D]."""
        return self.shared(xt, xq=None if xq is None else tuple(xq[:2]))

    def routed(self, xt: torch.Tensor, input_ids: torch.Tensor, xq: tuple | None = None) -> torch.Tensor:
        """xt [T, D] -> the router's top-k, then each token's rows through its experts, scaled by their
        weights: [T, k, D] (or [T, 1, D] already summed, expert parallelism) in xt's dtype."""
        weights, idx, scores = ops.moe_route(xt, self.gate_w, self.bias, self.tid2eid, input_ids.reshape(-1),
                                             self.topk, self.score_func, self.route_scale)
        tap(self.name + ".router.scores", scores)
        tap(self.name + ".router.experts", idx)
        tap(self.name + ".router.weights", weights)
        return self.dispatch(xt, weights, idx, xq)

    def wants_split(self, tokens: int) -> bool:
        """Would `dispatch_local` read xt's bf16 split form (xq's third element, `rms_norm_quant(split=True)`):
        one token (its k rows a stride-0 view) through local FP4 experts -- the GEMM then reads it in place
        instead of converting its input in a launch of its own."""
        return tokens == 1 and self.experts.input_fmt == "fp4" \
            and self.dispatch == self.dispatch_local

    def dispatch_local(self, xt: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor,
                       xq: tuple | None = None) -> torch.Tensor:
        """All experts are local: pairs = every token's top-k. -> [T, k, D] in xt's dtype (summed later, with
        the shared expert, by `moe_combine`). xq (xt's act_quant, the shared expert's input): the pairs' w1 /
        w3 input is its rows, each read by its k pairs (`grouped_gemm`'s topk) -- the same bytes as quantising
        the repeated rows, without the [T*k, D] copy of xt in its dtype, the k-fold act_quant (flash prefill:
        200 MB bf16 per layer) or a k-fold copy of the quantised rows (100 MB as FP8)."""
        T, k = idx.shape
        e = idx.reshape(-1)
        e = e - self.expert_offset if self.expert_offset else e
        # every routed id a local expert (all of them here; the router's ids and tid2eid lie in 0..n_experts-1)
        local = not self.expert_offset and len(self.experts) == self.n_experts
        if xq is not None and self.experts.quantised_input:
            if T == 1:  # one token (batch-1 decode): its k rows as a stride-0 view, no copy kernels
                a = tuple(t.reshape(1, -1).expand(k, -1) for t in xq)  # (q, s[, split form])
                out = self.experts.run(a, weights.reshape(-1), e, xt.dtype, every_row_local=local)
            else:  # the tokens' rows, each read by its k pairs in the GEMM: no [T*k, D] copy (grouped_gemm topk)
                a = tuple(t.reshape(T, -1) for t in xq[:2])
                out = self.experts.run(a, weights.reshape(-1), e, xt.dtype, topk=k, every_row_local=local)
        else:
            out = self.compute_experts(xt.repeat_interleave(k, dim=0), weights.reshape(-1), e)
        return out.view(T, k, -1)

    def compute_experts(self, x_rows: torch.Tensor, w: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """Row p through local expert e[p], scaled by w[p] before w2; e = -1 rows give 0.

        x_rows [P, D] compute dtype, w [P] f32, e [P] int64 (local ids) -> [P, D] compute dtype.
        One `grouped_gemm` per matrix over the stacked experts; no host sync on a sync-free backend.
        """
        return self.experts(x_rows, w, e)
