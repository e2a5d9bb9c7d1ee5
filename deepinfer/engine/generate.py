"""Generation: prefill each prompt into its cache row, then decode every running row together.

Prompts of different lengths share one batch: each row keeps its own position, finishes on EOS, a stop
string or `max_new_tokens`, and stops costing compute once finished (finished rows are dropped from the
decode batch). Sampling and logprobs go through the op registry (`sample`, `logprobs`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from deepinfer.model.transformer import Transformer
from deepinfer.ops import ops


@dataclass
class SamplingParams:
    """Per-request sampling: temperature 0 is greedy; top_k 0 and top_p 1 are off."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple = ()
    logprobs: int = 0  # top-N alternatives to report per token (the chosen token's logprob always)
    ignore_eos: bool = False

    def check(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens {self.max_new_tokens}: must be at least 1")
        if self.temperature < 0:
            raise ValueError(f"--temperature {self.temperature}: must be >= 0")
        if self.top_k < 0:
            raise ValueError(f"--top-k {self.top_k}: must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p {self.top_p}: must be in (0, 1]")
        if self.logprobs < 0:
            raise ValueError(f"--logprobs {self.logprobs}: must be >= 0")


@dataclass
class Completion:
    """One finished sequence."""

    input_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)  # top-1 minus top-2 raw logit
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str = ""
    text: str = ""


@dataclass
class GenerationResult:
    completions: list[Completion]
    prefill_s: float
    decode_s: float
    decode_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


def _record(c: Completion, tok: int, lp_row: torch.Tensor, logit_row: torch.Tensor, n_top: int) -> None:
    c.token_ids.append(tok)
    c.logprobs.append(float(lp_row[tok]))
    top2 = torch.topk(logit_row, 2).values
    c.margins.append(float(top2[0] - top2[1]))
    if n_top:
        v, i = torch.topk(lp_row, n_top)
        c.top_logprobs.append([(int(a), float(b)) for a, b in zip(i.tolist(), v.tolist())])


def generate(model: Transformer, prompts: list[list[int]], params: SamplingParams, eos_id: int,
             decode_text=None) -> GenerationResult:
    """Generate for each prompt (token ids, BOS included). `decode_text(ids) -> str` enables stop strings."""
    params.check()
    B = len(prompts)
    if B == 0:
        raise ValueError("no prompts")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt: the prompt needs at least one token")
    max_len = max(len(p) for p in prompts) + params.max_new_tokens
    if model.rows < B or model.max_seq_len < max_len:
        model.allocate(max(B, model.rows), max(max_len, model.max_seq_len))
    dev = model.device
    comps = [Completion(list(p)) for p in prompts]
    temp = torch.full((B,), params.temperature, device=dev)
    top_k = torch.full((B,), params.top_k, dtype=torch.long, device=dev)
    top_p = torch.full((B,), params.top_p, device=dev)
    # each row its own stream of noise: seed, row index; positions advance per token
    seeds = torch.tensor([params.seed * 1_000_003 + i for i in range(B)], dtype=torch.long, device=dev)

    t0 = time.perf_counter()
    last_logits = []
    for i, p in enumerate(prompts):  # one prefill per prompt into cache row i (lengths differ)
        logits, _ = model.prefill(torch.tensor([p], device=dev), rows=torch.tensor([i], device=dev))
        last_logits.append(logits[:, -1])
    logits = torch.cat(last_logits)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t1 = time.perf_counter()

    active = list(range(B))
    positions = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=dev)
    n_decoded = 0
    while active:
        idx = torch.tensor(active, device=dev)
        toks = ops.sample(logits, temp[idx], top_k[idx], top_p[idx], seeds[idx], positions[idx])
        lps = ops.logprobs(logits)
        toks_l = toks.tolist()
        still = []
        for j, row in enumerate(active):
            c = comps[row]
            _record(c, toks_l[j], lps[j], logits[j], params.logprobs)
            if toks_l[j] == eos_id and not params.ignore_eos:
                c.finish_reason = "eos"
            elif len(c.token_ids) >= params.max_new_tokens:
                c.finish_reason = "length"
            elif params.stop and decode_text is not None and _hit_stop(c, params.stop, decode_text):
                c.finish_reason = "stop"
            else:
                still.append((row, j))
        if not still:
            break
        active = [r for r, _ in still]
        keep = torch.tensor([j for _, j in still], device=dev)
        rows = torch.tensor(active, device=dev)
        logits = model.decode(toks[keep].view(-1, 1), positions[rows], rows=rows)[:, -1]
        positions[rows] += 1
        n_decoded += len(active)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    if decode_text is not None:
        for c in comps:
            c.text = decode_text(c.token_ids)
            if c.finish_reason == "stop":
                c.text = _cut_at_stop(c.text, params.stop)
    return GenerationResult(comps, t1 - t0, t2 - t1, n_decoded)


def _hit_stop(c: Completion, stops, decode_text) -> bool:
    tail = decode_text(c.token_ids[-16:])
    return any(s in tail for s in stops)


def _cut_at_stop(text: str, stops) -> str:
    cut = min((text.find(s) for s in stops if s in text), default=-1)
    return text[:cut] if cut >= 0 else text
