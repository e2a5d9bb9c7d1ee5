"""A built model's routed experts held in another form for a while: FP4 as stored, or requantised to per-128 FP8.

`load_model(experts="fp8")` requantises at load, before the model is built. A benchmark that times both forms in
one process (`deepinfer bench --against triton:experts=fp8,policy=fast`: the DeepGEMM-style expert path beside the
release's, with its drift from the same run's logits) needs the same model to switch and switch back. `held_as`
does that on the stacked expert matrices (`deepinfer.model.moe.StackedLinear`) of every layer and MTP block:
each FP4 stack [E, N, K/2] + ue8m0 scales becomes e4m3 [E, N, K] + fp32 [E, N/128, K/128] block scales
(`deepinfer.quant.requant.requant_fp4`, lossless while a block's group scales span at most 2^14), and the FP4
stacks come back on exit. The grouped GEMM reads the form from the weight's dtype at every call, so nothing else
changes; a CUDA graph captured inside the block holds the FP8 tensors and must not be replayed after it.

Memory: the FP8 stacks are twice the FP4 bytes, held beside them for the block (`fp8_bytes` says how much, so a
caller can refuse before any work).
"""

from __future__ import annotations

import contextlib

import torch

from deepinfer.quant.requant import EXPERT_FORMS, RequantReport, announce_lossy, requant_fp4


def _stacks(model) -> list[tuple[str, object]]:
    """(name, StackedLinear) of every routed-expert matrix of the model's layers and MTP blocks."""
    out = []
    for blk in list(model.layers) + [m.block for m in getattr(model, "mtp", [])]:
        ex = blk.ffn.experts
        for part in ("w13", "w1", "w3", "w2"):
            st = getattr(ex, part, None)
            if st is not None and st.weight is not None:
                out.append((f"{blk.ffn.name}.experts.{part}", st))
    return out


def fp8_bytes(model) -> int:
    """Bytes the FP8 form of the model's FP4 expert stacks takes (weights and fp32 block scales); 0 if none."""
    total = 0
    for _, st in _stacks(model):
        if st.fmt == "fp4":
            E, N, kh = st.weight.shape
            total += E * N * 2 * kh + E * -(-N // 128) * (2 * kh // 128) * 4
    return total


@contextlib.contextmanager
def held_as(model, form: str, log=lambda msg: None):
    """Within the block the model's FP4 routed experts are `form` ("fp4": as they are; "fp8": requantised per
    128 x 128 block) -> yields the requantisation reports (one per stack; [] for "fp4"). A lossy stack is said on
    stderr with its measured error, never silently. The FP4 stacks are put back on exit, also on an error."""
    if form not in EXPERT_FORMS:
        raise ValueError(f"experts={form}: choose {' or '.join(EXPERT_FORMS)}")
    saved: list[tuple[object, torch.Tensor, torch.Tensor, str]] = []
    reports: list[RequantReport] = []
    try:
        if form == "fp8":
            stacks = [(n, st) for n, st in _stacks(model) if st.fmt == "fp4"]
            if stacks:
                log(f"requantising {len(stacks)} FP4 expert stacks to per-128 FP8 ...")
            for name, st in stacks:
                w8, sc, rep = requant_fp4(st.weight, st.scale, name)
                saved.append((st, st.weight, st.scale, st.fmt))
                st.weight, st.scale, st.fmt = w8, sc, "fp8"
                reports.append(rep)
            announce_lossy(reports, "expert stacks")
        yield reports
    finally:
        for st, w, s, fmt in reversed(saved):
            st.weight, st.scale, st.fmt = w, s, fmt
        saved.clear()
