"""How far a `bench --against` configuration's numbers are from the main configuration's, in the same run.

A configuration may trade agreement for speed (`policy=fast`: FP8 sums promoted once per 128-K block; another
backend's kernels): its TTFT beside the main one's means little without the drift it carries. Both run the timed
prompt (the same random tokens, the same weights) through one eager prefill; the logits of its last
`DRIFT_POSITIONS` positions are compared: relative error over them, the largest absolute difference, how many
top-1 choices agree, and for those that flip, the largest top1 - top2 margin the main configuration had there --
a flip at a margin of a few bf16 ulps is a near-tie, one at a margin of several logits is a divergence.

The prompt's logits come from the prefill path only. `drift_logits` adds the batch-1 decode path (where the fused
decode ops run): `DRIFT_DECODE_STEPS` eager decode steps after the same prompt, fed the same fixed tokens in both
configurations (teacher-forced, so one flip does not change the later inputs), compared the same way.
"""

from __future__ import annotations

import torch

from deepinfer.bench.workload import random_prompts

DRIFT_POSITIONS = 64
"""Positions compared (the prompt's last ones): enough to count flips, few enough that the kept logits stay small
(64 x the vocabulary in fp32: 33 MB at V4's 129 280)."""


def prefill_logits(model, cfg, P: int, device, seed: int) -> torch.Tensor:
    """The timed prompt (row 0, `random_prompts(cfg, 1, P, seed)`) prefilled once, eagerly, under the current
    dispatch and settings -> its last min(P, DRIFT_POSITIONS) positions' logits [n, V] float32 (the head runs
    on those positions' hidden states only: never [P, V] of logits). Row 0 is overwritten from position 0; the
    caches are allocated only where the current allocation cannot hold the prompt."""
    if model.rows < 1 or model.max_seq_len < P + 1:
        model.allocate(1, P + 1)
    ids = random_prompts(cfg, 1, P, seed).to(device)
    row = torch.zeros(1, dtype=torch.long, device=device)
    n = min(P, DRIFT_POSITIONS)
    _, h = model.prefill(ids, rows=row)
    with torch.inference_mode():
        logits = model.head(h[:, -n:])
    return logits[0].float().clone()


DRIFT_DECODE_STEPS = 8
"""Decode steps compared after the prompt (one row): each runs every decode kernel of a layer once."""


def drift_logits(model, cfg, P: int, device, seed: int, steps: int = DRIFT_DECODE_STEPS
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One prefill of the timed prompt into row 0 (`prefill_logits`), then `steps` eager decode steps of that row
    through a `DecodeRunner` (on its side streams, as the engine issues them) fed fixed random tokens -> (the
    prompt's last positions' logits [n, V], the steps' logits [steps, V]), float32. The caches are allocated only
    where the current allocation is too short."""
    from deepinfer.engine.runner import DecodeRunner

    if model.rows < 1 or model.max_seq_len < P + steps + 1:
        model.allocate(1, P + steps + 1)
    prompt = prefill_logits(model, cfg, P, device, seed)
    row = torch.zeros(1, dtype=torch.long, device=device)
    toks = random_prompts(cfg, steps, 1, seed + 3).to(device)  # [steps, 1]: step s feeds token s
    runner = DecodeRunner(model, 1)
    out = [runner.decode(toks[s:s + 1], torch.full((1,), P + s, dtype=torch.long, device=device), row)
           for s in range(steps)]
    return prompt, torch.cat(out).float().clone()


def drift(test: torch.Tensor, main: torch.Tensor) -> dict:
    """test, main [n, V] (`prefill_logits` of two configurations) -> {positions, rel_err, max_abs, top1_agree
    (the fraction of positions whose top-1 is the same), flips, max_flip_margin (the main's largest top1 - top2
    margin at a flipped position; None without flips)}. A NaN in either side is reported as NaN, never as
    agreement."""
    if test.shape != main.shape:
        raise ValueError(f"drift: logits of shapes {tuple(test.shape)} and {tuple(main.shape)}")
    t, m = test.double(), main.double()
    diff = t - m
    rel = float(diff.norm() / m.norm()) if float(m.norm()) > 0 else float(diff.norm())
    top2 = torch.topk(m, 2, dim=-1)
    margins = top2.values[:, 0] - top2.values[:, 1]
    same = t.argmax(-1) == m.argmax(-1)
    bad = torch.isnan(t).any(-1) | torch.isnan(m).any(-1)
    same &= ~bad
    flipped = ~same
    return {"positions": int(m.shape[0]), "rel_err": float("nan") if bool(bad.any()) else rel,
            "max_abs": float(diff.abs().max()) if not bool(bad.any()) else float("nan"),
            "top1_agree": float(same.double().mean()), "flips": int(flipped.sum()),
            "max_flip_margin": float(margins[flipped & ~bad].max()) if bool((flipped & ~bad).any()) else None}
