"""Run a prompt (+ K greedy decode steps) under a tensor capture and hand back named tensors.

Names are the model's tap names (`dumps/README.md`); decode step k (1-based) prefixes `step{k}.`.
The batch is one sequence, and every tensor is stored with its batch axis removed, so the first axis
is always the token axis: [T, ...] for the prompt, [1, ...] for a decode step (the router taps are
already [T, ...]). `logits` of the prompt are [T, V] float32 (prefill with all_logits).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from deepinfer.capture import capturing, set_prefix
from deepinfer.model.transformer import Transformer

ALWAYS = ("input_ids", "logits")


@dataclass
class DumpRun:
    """What one dump run produced. `tokens[i]` is the greedy (or forced) token after position T-1+i."""

    prompt_ids: list[int]
    tokens: list[int]
    records: list[tuple[str, torch.Tensor]] = field(default_factory=list)


def parse_layers(layer: list[int] | None, layers: str | None, n_layers: int) -> list[int] | None:
    """`--layer N` (repeatable) and `--layers 0-3|0,2|all` -> sorted layer ids, or None for all."""
    chosen: set[int] = set(layer or [])
    if layers:
        if layers.strip().lower() == "all":
            return None
        for part in layers.split(","):
            part = part.strip()
            m = re.fullmatch(r"(\d+)\s*-\s*(\d+)", part)
            if m:
                lo, hi = int(m[1]), int(m[2])
                if lo > hi:
                    raise ValueError(f"--layers {layers!r}: range {part} is empty")
                chosen.update(range(lo, hi + 1))
            elif part.isdigit():
                chosen.add(int(part))
            else:
                raise ValueError(f"--layers {layers!r}: expected all, N, N-M or a comma list")
    if not chosen:
        return None
    bad = sorted(i for i in chosen if not 0 <= i < n_layers)
    if bad:
        raise ValueError(f"layer {bad[0]} does not exist (the model has layers 0-{n_layers - 1})")
    return sorted(chosen)


def selection(layers: list[int] | None) -> re.Pattern | None:
    """Capture filter: the chosen layers' taps plus input_ids/logits of every step (None = everything)."""
    if layers is None:
        return None
    ids = "|".join(str(i) for i in layers)
    return re.compile(rf"^(?:step\d+\.)?(?:{'|'.join(ALWAYS)}$|layers\.(?:{ids})\.)")


def _unbatch(name: str, t: torch.Tensor) -> torch.Tensor:
    # Router taps are [B·S, ...] (flattened over the batch); every other tap leads with B == 1.
    if ".router." in name:
        return t
    if t.dim() == 0 or t.size(0) != 1:
        raise RuntimeError(f"tap {name!r} has shape {tuple(t.shape)}: expected a leading batch axis of 1")
    return t[0]


def run_dump(model: Transformer, prompt_ids: list[int], steps: int = 0, layers: list[int] | None = None,
             force_tokens: list[int] | None = None) -> DumpRun:
    """Prefill `prompt_ids` (all logits), then `steps` decode steps feeding the greedy token (or
    `force_tokens[i]` where given: teacher forcing on another run's tokens, so positions line up)."""
    if not prompt_ids:
        raise ValueError("empty prompt: the prompt needs at least one token")
    if steps < 0:
        raise ValueError(f"--steps {steps}: must be >= 0")
    dev = model.device
    T = len(prompt_ids)
    # The decode taps of the indexer see the whole cache ([max_entries] wide): allocate exactly
    # T + steps so two dumps of the same prompt and steps have the same shapes on every backend.
    model.allocate(1, T + steps)
    run = DumpRun(list(prompt_ids), [])

    def pick(logits_row: torch.Tensor, i: int) -> int:
        if force_tokens is not None and i < len(force_tokens):
            return int(force_tokens[i])
        return int(logits_row.float().argmax())  # first maximal index, as ops.sample's greedy path

    with capturing(selection(layers)) as cap:
        set_prefix("")
        logits, _ = model.prefill(torch.tensor([prompt_ids], device=dev), all_logits=True)
        run.tokens.append(pick(logits[0, -1], 0))
        for k in range(1, steps + 1):
            set_prefix(f"step{k}.")
            pos = torch.tensor([T + k - 1], device=dev)
            logits = model.decode(torch.tensor([[run.tokens[-1]]], device=dev), pos)
            run.tokens.append(pick(logits[0, -1], k))
    seen: dict[str, int] = {}
    for name, t in cap.records:
        n = seen.get(name, 0)
        seen[name] = n + 1
        run.records.append((name if n == 0 else f"{name}#{n}", _unbatch(name, t)))
    return run


def save(run: DumpRun, path: str, attrs: dict) -> None:
    """Write a run atomically: its tensors in capture order, then `generated_ids` [steps + 1] int64."""
    from deepinfer.debug.h5schema import DumpWriter

    with DumpWriter(path, attrs) as w:
        for i, (name, t) in enumerate(run.records):
            w.add(name, t, order=i)
        w.add("generated_ids", torch.tensor(run.tokens, dtype=torch.int64), order=len(run.records))
