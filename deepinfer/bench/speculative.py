"""`deepinfer bench --speculate K`: the speculative step's measured cost against plain decode, the measured
acceptance, and tokens/s projected at given acceptance rates from those measured costs.

Per batch size B: B rows prefilled (P random tokens) and their MTP block run over the prompt, then `steps`
greedy speculative steps (`SpecStep`: K drafts, one verify of K + 1 positions, acceptance, commits, the MTP
block's catch-up) back to back after WARMUP_STEPS, all on the device (positions advance by each row's accepted
count without a host read), timed with one sync at the end. Reported: ms per step, its ratio to the plain decode
step of the same B measured in the same run, the measured acceptance (accepted / drafted) and tokens per step,
and the projection: with each draft accepted with probability a independently, a step emits
E(a) = (1 - a^(K+1)) / (1 - a) tokens per row, so tokens/s = B · E(a) / step time, against plain decode's
B / step time. Random-weight presets accept almost nothing (their MTP block is not trained to predict the main
model), so their measured acceptance says nothing about a real checkpoint's: the projection is the number to read.
"""

from __future__ import annotations

import time

import torch

from deepinfer.bench.rates import sync
from deepinfer.bench.timing import captured_or_eager
from deepinfer.bench.workload import WARMUP_STEPS, random_prompts

PROJECTED_RATES = (0.5, 0.7, 0.9)


def expected_tokens(a: float, k: int) -> float:
    """Tokens a step emits per row when each of k drafts is accepted with probability a (until the first
    rejection), plus the token after them: sum_{i=0..k} a^i."""
    return float(k + 1) if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


def time_speculative(model, cfg, B: int, P: int, steps: int, k: int, device, seed: int, plain_ms: float | None,
                     graphs: bool = False) -> dict:
    """Prefill B rows of P tokens, then time `steps` speculative steps of K drafts (module docstring)."""
    from deepinfer.engine.speculative import SpecStep

    max_len = P + (WARMUP_STEPS + steps) * (k + 1) + k + 1
    model.allocate(B + 1, max_len)
    prompts = random_prompts(cfg, B, P, seed + 1).to(device)
    rows = torch.arange(B, device=device)
    toks, mlg, mh = [], [], []
    for i in range(B):
        logits, h = model.prefill(prompts[i:i + 1], rows=rows[i:i + 1])
        t = logits[0, -1].argmax().view(1, 1)
        lg, out = model.mtp_prefill(h, torch.cat([prompts[i:i + 1, 1:], t], 1), rows=rows[i:i + 1], with_streams=True)
        toks.append(t.view(1))
        mlg.append(lg[0, -1])
        mh.append(out[0, -1])
    tok, mlg, mh = torch.cat(toks), torch.stack(mlg), torch.stack(mh)
    pos = torch.full((B,), P, dtype=torch.long, device=device)
    temp, top_p = torch.zeros(B, device=device), torch.ones(B, device=device)
    zeros = torch.zeros(B, dtype=torch.long, device=device)
    step, graph_error, capture_s = captured_or_eager(lambda g: SpecStep(model, k, B, graphs=g), graphs)
    accepted = torch.zeros(B, dtype=torch.long, device=device)
    for s in range(WARMUP_STEPS + steps):
        if s == WARMUP_STEPS:
            sync(device)
            accepted.zero_()
            t0 = time.perf_counter()
        n_acc, tok, _, _, mlg, mh = step(tok, pos, rows, mlg, mh, temp, zeros, top_p, zeros)
        pos = pos + n_acc + 1
        accepted += n_acc
    sync(device)
    dt = (time.perf_counter() - t0) / steps
    acc = int(accepted.sum()) / (B * steps * k)
    per_step = 1 + int(accepted.sum()) / (B * steps)
    out = {"batch": B, "k": k, "ms_per_step": dt * 1e3, "plain_ms_per_step": plain_ms,
           "step_vs_plain": dt * 1e3 / plain_ms if plain_ms else None,
           "acceptance_measured": acc, "tokens_per_step_measured": per_step, "tokens_per_s_measured": B * per_step / dt,
           "plain_tokens_per_s": B / (plain_ms / 1e3) if plain_ms else None,
           "projected": [{"acceptance": a, "tokens_per_step": expected_tokens(a, k),
                          "tokens_per_s": B * expected_tokens(a, k) / dt,
                          "vs_plain": expected_tokens(a, k) * plain_ms / (dt * 1e3) if plain_ms else None}
                         for a in PROJECTED_RATES],
           "mode": "graphs" if step.graphs else "eager", "graph_error": graph_error, "capture_s": capture_s}
    return out
