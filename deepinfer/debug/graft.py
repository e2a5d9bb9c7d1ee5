"""Layer grafting: the error each layer adds on its own, against a reference dump (from this host or another).

Each layer of the local model runs on the reference dump's input to that layer -- its hc residual streams,
`layers.L.hc_attn.in` [S, hc, D] -- and its output is compared with the dump's `layers.L.hc_ffn.out`: the
prompt (prefill from position 0, which also fills the layer's caches from the reference's inputs), then
each decode step k on `stepK.layers.L.hc_attn.in` at position T + k - 1, fed the token the reference
generated. A layer's error is then its own, not inherited: the first layer whose own error stands out is
where a divergence is born, whichever host made the reference.

A dump needs, for every grafted layer L: `input_ids`, `generated_ids` (decode steps), `layers.L.hc_attn.in`
and `layers.L.hc_ffn.out` (and their `stepK.` forms); `deepinfer dump` writes them for the layers it
captures (all by default).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

import torch

from deepinfer.debug.comparators import rel_norm

@dataclass
class LayerError:
    layer: int
    prefill: float  # ||local - ref|| / ||ref|| of the block's output over the prompt
    decode: float | None  # the worst decode step's, None without decode steps
    worst_step: int | None


@dataclass
class GraftResult:
    ref: str
    layers: list[LayerError] = field(default_factory=list)
    steps: int = 0
    tol: float = 1e-2

    @property
    def worst(self) -> LayerError | None:
        return max(self.layers, key=lambda e: max(e.prefill, e.decode or 0.0), default=None)

    @property
    def first_over(self) -> LayerError | None:
        """The first layer whose own error exceeds `tol`: where the divergence is born."""
        return next((e for e in self.layers if max(e.prefill, e.decode or 0.0) > self.tol), None)

    def to_dict(self) -> dict:
        d = asdict(self)
        fo = self.first_over
        d["born_at"] = None if fo is None else fo.layer
        return d




def grafted_layers(names: list[str]) -> list[int]:
    """Layers the dump holds both ends of (prompt taps)."""
    have = set(names)
    ids = sorted({int(m[1]) for n in names if (m := re.fullmatch(r"layers\.(\d+)\.hc_attn\.in", n))})
    return [L for L in ids if f"layers.{L}.hc_ffn.out" in have]


def graft(model, dump, layers: list[int] | None = None, tol: float = 1e-2) -> GraftResult:
    """`dump`: a `DumpReader` (or anything with `names()`, `tensor(name)`, `attrs`). Runs each layer alone."""
    names = list(dump.names())
    avail = grafted_layers(names)
    if not avail:
        raise ValueError("the dump holds no layer's hc_attn.in and hc_ffn.out taps: dump all layers "
                         "(deepinfer dump, the default) to graft")
    if layers is None:
        layers = avail
    missing = [L for L in layers if L not in avail]
    if missing:
        raise ValueError(f"the dump holds no taps of layer(s) {missing} (it has {avail})")
    if max(layers) >= len(model.layers):
        raise ValueError(f"layer {max(layers)}: the local model has {len(model.layers)} layers")
    if "input_ids" not in names:
        raise ValueError("the dump holds no input_ids")
    ids = dump.tensor("input_ids").reshape(1, -1).long()
    T = ids.size(1)
    gen = dump.tensor("generated_ids").long().tolist() if "generated_ids" in names else []
    steps = sum(1 for k in range(1, len(gen) + 1) if f"step{k}.layers.{layers[0]}.hc_attn.in" in names)
    dev, dt = model.device, model.numerics.dtype
    res = GraftResult(ref=str(dump.attrs.get("command", "")), steps=steps, tol=tol)
    from deepinfer.ops import ops

    with torch.inference_mode():
        for L in layers:
            block = model.layers[L]
            model.allocate(1, T + steps + 1)
            rows = torch.zeros(1, dtype=torch.long, device=dev)
            pos = torch.arange(T, device=dev).unsqueeze(0)
            ops.layer = L
            try:
                ctx = model._ctx(ids, rows, pos, prefill=True)
                out = block(dump.tensor(f"layers.{L}.hc_attn.in").to(dev, dt).unsqueeze(0), ctx, ids.to(dev))
                pre = rel_norm(out[0], dump.tensor(f"layers.{L}.hc_ffn.out"))
                dec = []
                for k in range(1, steps + 1):
                    tok = torch.tensor([[gen[k - 1]]], device=dev)
                    ctx = model._ctx(tok, rows, torch.tensor([[T + k - 1]], device=dev), prefill=False)
                    h = dump.tensor(f"step{k}.layers.{L}.hc_attn.in").to(dev, dt).unsqueeze(0)
                    out = block(h, ctx, tok)
                    dec.append(rel_norm(out[0], dump.tensor(f"step{k}.layers.{L}.hc_ffn.out")))
            finally:
                ops.layer = None
            worst = max(range(len(dec)), key=dec.__getitem__) if dec else None
            res.layers.append(LayerError(L, pre, dec[worst] if dec else None, None if worst is None else worst + 1))
    return res
