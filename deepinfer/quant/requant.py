"""FP4 experts requantised to FP8 with one scale per 128 x 128 block: the step a per-128 GEMM needs, measured.

DeepGEMM's SM90 FP8 GEMMs take scales at a K granularity of 128 only, in fp32 (the field notes' item C3), so
V4's FP4 routed experts (e2m1, one ue8m0 scale per 32 K elements) must be requantised to FP8 e4m3 with a scale
per 128 x 128 block before they can run there -- once, at load. The official `convert.py` does the same
(`deepinfer.quant.formats.fp4_to_fp8_block`): block scale = the block's largest 32-group scale / 2^6, each group's
values multiplied by its scale over the block scale (a power of two <= 2^6).

Lossless exactly when, in every block, no 32-group scale lies more than 2^14 below the block's largest: the
e2m1 values (at most two significant bits) times an offset >= 2^-8 stay exact in e4m3 (its subnormal step is
2^-9). Beyond that the small groups' smallest values round or flush to zero. `requant_fp4` returns the FP8 form
with a `RequantReport` that says which, per tensor: how many blocks and values changed and by how much, so the
drift a per-128 path carries is measured where it is born, never assumed.
"""

from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from deepinfer.quant.formats import dequant_fp4, dequant_fp8_block, float_to_e8m0, fp4_to_fp8_block, scale_f32

BLOCK = 128
GROUP = 32
LOSSLESS_SPAN_LOG2 = 14  # group scales within 2^14 of their block's largest: the upcast is exact


@dataclass
class RequantReport:
    """What requantising one FP4 tensor to per-128 FP8 changed (all values in the dequantised real domain)."""

    name: str
    shape: tuple  # the logical weight [..., N, K]
    blocks: int  # 128 x 128 blocks
    lossy_blocks: int  # blocks with at least one changed value
    lossy_values: int
    max_abs_err: float
    rel_err: float  # ||after - before|| / ||before|| over the tensor (0 for an all-zero tensor)
    max_span_log2: int  # the largest log2(block's max group scale / a group scale) over the tensor's blocks

    @property
    def lossless(self) -> bool:
        return self.lossy_values == 0

    def to_dict(self) -> dict:
        return {**asdict(self), "shape": list(self.shape), "lossless": self.lossless}


def requant_fp4(packed: Tensor, scale: Tensor, name: str = "") -> tuple[Tensor, Tensor, RequantReport]:
    """packed int8/uint8 [..., N, K/2] (e2m1, low nibble first), scale [..., N, K/32] (ue8m0, or decoded to powers
    of two in a float dtype, the form the model holds them in) ->
    (w_fp8 float8_e4m3fn [..., N, K], block scales float32 [..., ceil(N/128), K/128], report).

    Leading dimensions (stacked experts) are requantised one matrix at a time, so no 128-row block mixes two
    experts. The fp32 block scales are powers of two (exact). A NaN scale (byte 255) raises."""
    if packed.dim() < 2:
        raise ValueError(f"requant_fp4 {name}: packed must be [..., N, K/2], got {tuple(packed.shape)}")
    *lead, n, kh = packed.shape
    k = 2 * kh
    if scale.is_floating_point() and scale.dtype != getattr(torch, "float8_e8m0fnu", None):
        scale = float_to_e8m0(scale)  # exact: raises if a scale is not a power of two
    if k % BLOCK:
        raise ValueError(f"requant_fp4 {name}: K = {k} is not a multiple of {BLOCK}")
    flat_p = packed.reshape(-1, n, kh)
    flat_s = scale.reshape(-1, n, k // GROUP)
    nb, kb = math.ceil(n / BLOCK), k // BLOCK
    # written matrix by matrix into the outputs: no list of copies to stack (a flash layer's stacked w1|w3 is
    # 4.3 GB as FP8, which a stack would need twice)
    w = torch.empty(flat_p.size(0), n, k, dtype=torch.float8_e4m3fn, device=packed.device)
    sc = torch.empty(flat_p.size(0), nb, kb, dtype=torch.float32, device=packed.device)
    blocks = lossy_blocks = lossy = 0
    max_abs, err2, ref2, span = 0.0, 0.0, 0.0, 0
    for i, (p, s) in enumerate(zip(flat_p, flat_s)):
        w8, sb = fp4_to_fp8_block(p, s)
        before = dequant_fp4(p, s)
        after = dequant_fp8_block(w8, sb)
        diff = (after - before).abs()
        changed = diff != 0
        pad = nb * BLOCK - n
        per_block = torch.nn.functional.pad(changed, (0, 0, 0, pad)).view(nb, BLOCK, kb, BLOCK).any(3).any(1)
        blocks += nb * kb
        lossy_blocks += int(per_block.sum())
        lossy += int(changed.sum())
        max_abs = max(max_abs, float(diff.max()) if diff.numel() else 0.0)
        err2 += float(diff.double().square().sum())
        ref2 += float(before.double().square().sum())
        sf = scale_f32(s)  # [N, K/32], powers of two
        grp = torch.nn.functional.pad(sf, (0, 0, 0, pad), value=1.0).view(nb, BLOCK, kb, BLOCK // GROUP)
        top = grp.amax(dim=(1, 3), keepdim=True)
        span = max(span, int(torch.log2(top / grp).max()))
        w[i].copy_(w8)
        sc[i].copy_(scale_f32(sb))
        del w8, before, after, diff, changed
    w, sc = w.view(*lead, n, k), sc.view(*lead, nb, kb)
    rep = RequantReport(name, (*lead, n, k), blocks, lossy_blocks, lossy, max_abs,
                        math.sqrt(err2 / ref2) if ref2 else 0.0, span)
    return w, sc, rep


def announce_lossy(reports: list[RequantReport], what: str) -> None:
    """One stderr line where any of `reports` changed values (how many of them, the worst with its error), never
    silent; nothing where every one is lossless. `what` names the reports' kind ("expert tensors", "stacks")."""
    lossy = [r for r in reports if not r.lossless]
    if lossy:
        w = max(lossy, key=lambda r: r.rel_err)
        print(f"deepinfer: experts=fp8 changed values in {len(lossy)} of {len(reports)} {what} (worst {w.name}: "
              f"{w.lossy_values} values, rel err {w.rel_err:.3g}; `deepinfer probe requant`)", file=sys.stderr)


def summary(reports: list[RequantReport]) -> dict:
    """What a set of requantisations changed, for a report: {stacks, lossy_stacks, max_rel_err, max_span_log2}."""
    return {"stacks": len(reports), "lossy_stacks": sum(not r.lossless for r in reports),
            "max_rel_err": max((r.rel_err for r in reports), default=0.0),
            "max_span_log2": max((r.max_span_log2 for r in reports), default=0)}


EXPERT_FORMS = ("fp4", "fp8")
"""How routed experts are held: fp4 as the release stores them, fp8 requantised per 128 x 128 block (`requant_fp4`):
the form DeepGEMM's SM90 path runs, for comparing the two on the same model (a SPEC's experts=)."""

def requant_experts(state: dict) -> list[RequantReport]:
    """Replace every FP4 routed-expert weight of an official-format `state` (int8 [N, K/2] with its per-32
    `.scale`) by its per-128 FP8 form (e4m3 [N, K] with fp32 [N/128, K/128] scales), in place -> one report per
    tensor. The model built on the state then holds FP8 experts (`deepinfer.model.weights` reads the format
    from the dtype)."""
    from deepinfer.checkpoint.reader import routed_expert, scale_name  # not at the top: the reader imports quant

    reports = []
    for name in [n for n in state if routed_expert(n) is not None and n.endswith(".weight")]:
        w = state[name]
        if w.dtype not in (torch.int8, torch.uint8):
            continue
        sname = scale_name(name)
        w8, sc, rep = requant_fp4(w, state[sname], name)
        state[name], state[sname] = w8, sc
        reports.append(rep)
    return reports
