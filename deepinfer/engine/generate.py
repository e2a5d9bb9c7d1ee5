"""Generation: continuous batching (`engine.scheduler`) over a fixed number of cache rows, with the
decode step run by `engine.runner.DecodeRunner` (eager, or CUDA graphs per batch-size bucket).

Prompts of different lengths and sampling settings share one batch: each row keeps its own position and
parameters, finishes on EOS, a stop string or `max_new_tokens`, and frees its row at once for a waiting
prompt. Sampling and logprobs go through the op registry (`sample`, `logprobs`).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

import torch

from deepinfer import settings
from deepinfer.engine.memory import (CHUNK_BUDGET, MemoryRefused, auto_prefill_chunk, available_bytes,
                                     cache_bytes, check_fits)
from deepinfer.engine.prefill_runner import PREFILL_SIZES, prefill_runner
from deepinfer.engine.runner import DecodeRunner
from deepinfer.engine.scheduler import Request, Scheduler
from deepinfer.engine.speculative import SpecScheduler, SpecStep, check_speculate
from deepinfer.engine.steps import steps_of
from deepinfer.model.transformer import Transformer


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
    guide: object = None  # guided decoding: an `engine.guided.Guide` (logits masked before sampling)

    def check(self, vocab_size: int | None = None) -> None:
        for k in ("temperature", "top_p"):
            v = getattr(self, k)
            if not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"--{k.replace('_', '-')} {v}: must be a finite number")
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
        if any(s == "" for s in self.stop):
            raise ValueError("--stop '': an empty stop string matches before any text; give a non-empty one")
        if vocab_size is not None and self.logprobs > vocab_size:
            raise ValueError(f"--logprobs {self.logprobs}: more alternatives than the {vocab_size} tokens of "
                             "the vocabulary")


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
    constraint: dict | None = None  # guided: kind, satisfied, status (complete / cut by max tokens / ...)
    # speculative decoding (--speculate K): verify steps, draft tokens proposed and accepted
    spec_steps: int = 0
    spec_drafted: int = 0
    spec_accepted: int = 0

    def speculation(self) -> dict:
        """drafted, accepted, acceptance rate (accepted / drafted) and mean accepted length (tokens emitted
        per verify step: 1 + accepted / steps, as vLLM reports it)."""
        return {"steps": self.spec_steps, "drafted": self.spec_drafted, "accepted": self.spec_accepted,
                "acceptance_rate": self.spec_accepted / self.spec_drafted if self.spec_drafted else 0.0,
                "mean_accepted_length": 1 + self.spec_accepted / self.spec_steps if self.spec_steps else 0.0}


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
    c.margins.append(float(top2[0] - top2[1]))  # inf where a guided mask allowed one token only
    if n_top:
        v, i = torch.topk(lp_row, n_top)
        c.top_logprobs.append([(int(a), float(b)) for a, b in zip(i.tolist(), v.tolist()) if b != float("-inf")])


def generate(model: Transformer, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
             eos_id: int, decode_text=None, max_batch: int | None = None, graphs: bool = False,
             prefill_chunk: int | None = None,
             pad_to_buckets: bool = False, on_token=None, speculate: int = 0,
             prefill_graphs: bool | None = None) -> GenerationResult:
    """Generate for each prompt (token ids, BOS included). `decode_text(ids) -> str` enables stop strings.

    params: one `SamplingParams` for every prompt, or a list with one per prompt.
    max_batch: cache rows (slots) = sequences decoding at once (default: min(64, len(prompts))); more
    prompts wait and are admitted as sequences finish (continuous batching, `engine.scheduler`).
    graphs: replay the decode step from CUDA graphs (CUDA only; ignored on other devices).
    prefill_chunk: prefill at most this many prompt tokens per scheduler step (0: whole prompts), so
    running sequences keep decoding while a long prompt is prefilled; the tokens are the same. None:
    sized from the free memory (`engine.memory.auto_prefill_chunk`: whole prompts when they fit).
    A request that cannot fit (the model's context, the caches) is refused before anything is allocated.
    pad_to_buckets: run the graph mode's bucket/padding/spare-row path eagerly (testing).
    on_token(index, completion): called after each token is recorded (streaming output).
    speculate: K > 0 decodes with K MTP draft tokens per step (`engine.speculative`): greedy rows give the
    tokens of plain decoding, sampled rows the target's distribution; 0 (default): plain decode steps.
    prefill_graphs: with `graphs`, replay prompt chunks of the captured lengths as CUDA graphs
    (`engine.prefill_runner`; None: $DEEPINFER_PREFILL_GRAPHS, off by default). The tokens are the same.
    """
    B = len(prompts)
    if B == 0:
        raise ValueError("no prompts")
    plist = list(params) if isinstance(params, (list, tuple)) else [params] * B
    if len(plist) != B:
        raise ValueError(f"{len(plist)} SamplingParams for {B} prompts: give one, or one per prompt")
    for p in plist:
        p.check(model.cfg.vocab_size)
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt: the prompt needs at least one token")
    V = model.cfg.vocab_size
    for i, pr in enumerate(prompts):  # on a GPU an id out of range reads past the embedding and tid2eid in silence
        if 0 <= min(pr) and max(pr) < V:
            continue
        bad = next(t for t in pr if not 0 <= int(t) < V)
        raise ValueError(f"prompt {i}: token id {int(bad)} at position {list(pr).index(bad)} is outside the "
                         f"vocabulary (0..{V - 1})")
    slots = min(B, 64) if max_batch is None else max_batch
    if slots < 1:
        raise ValueError(f"--max-batch {slots}: must be at least 1")
    slots = min(slots, B)
    if speculate:
        check_speculate(model, speculate)
        if any(p.guide is not None for p in plist):
            raise ValueError(f"speculate {speculate} with a guided constraint: the speculative step does not apply "
                             "the token bitmask to drafts and verify yet")
    # + speculate: a verify step runs K positions past the last token it may keep
    max_len = max(len(pr) + p.max_new_tokens for pr, p in zip(prompts, plist)) + speculate
    ctx = model.cfg.max_position_embeddings
    if max_len > ctx and len({p.max_new_tokens for p in plist}) > 1:  # per-request budgets: name the request
        i = max(range(B), key=lambda j: len(prompts[j]) + plist[j].max_new_tokens)
        raise MemoryRefused(f"request {i + 1} of {B}: its {len(prompts[i])} prompt tokens plus its max_new_tokens "
                            f"{plist[i].max_new_tokens} make {max_len} positions, more than the model's context of {ctx}")
    if prefill_graphs is None:
        prefill_graphs = settings.flag("DEEPINFER_PREFILL_GRAPHS")
    if prefill_graphs and not (graphs and model.device.type == "cuda"):
        why = f"the device is {model.device.type}" if model.device.type != "cuda" else \
            "the decode step runs eagerly (--eager, or the torch reference)"
        print(f"deepinfer: prefill graphs need CUDA and decode graphs (a kernel backend, no --eager); {why}, so "
              "prompts prefill eagerly", file=sys.stderr)
        prefill_graphs = False
    prefill_graphs = bool(prefill_graphs)
    prefill_chunk = plan_memory(model, prompts, slots + 1, max_len, prefill_chunk, prefill_graphs)
    if model.rows < slots + 1 or model.max_seq_len < max_len:  # + 1: the runner's spare (padding) row
        model.allocate(max(slots + 1, model.rows), max(max_len, model.max_seq_len))
    runner = _spec_step(model, speculate, slots, graphs, pad_to_buckets) if speculate else \
        _runner(model, slots, graphs, pad_to_buckets)
    runner.capture()  # graph mode: before any prefill, so a capture error costs nothing

    comps = [Completion(list(pr)) for pr in prompts]
    record = _record
    if on_token is not None:
        index = {id(c): i for i, c in enumerate(comps)}

        def record(c, *a):
            _record(c, *a)
            on_token(index[id(c)], c)
    prefill = prefill_runner(model, True).prefill if prefill_graphs else None
    sched = (SpecScheduler if speculate else Scheduler)(model, runner, eos_id, record,
                      lambda c, stops: decode_text is not None and _hit_stop(c, stops, decode_text), max_batch=slots,
                      prefill_chunk=prefill_chunk, prefill=prefill)
    for i, (pr, p, c) in enumerate(zip(prompts, plist, comps)):
        sched.submit(Request(i, list(pr), p, c))
    st = sched.run()
    if decode_text is not None:
        for c, p in zip(comps, plist):
            c.text = decode_text(c.token_ids)
            if c.finish_reason == "stop":
                c.text = _cut_at_stop(c.text, p.stop)
    return GenerationResult(comps, st.prefill_s, st.decode_s, st.decode_tokens)


def plan_memory(model: Transformer, prompts: list[list[int]], rows: int, max_len: int,
                prefill_chunk: int | None, prefill_graphs: bool = False) -> int:
    """Refuse what cannot run (past the model's context, caches beyond the free memory) -> the prefill
    chunk to use (None: sized from the free memory). prefill_graphs: a sized chunk is one of the captured
    lengths (`graph_chunk`), and the graphs' pool is counted."""
    cfg = model.cfg
    longest = max(len(p) for p in prompts)
    if max_len > cfg.max_position_embeddings:
        raise MemoryRefused(f"a prompt of {longest} tokens plus --max-new-tokens makes {max_len} positions, "
                            f"more than the model's context of {cfg.max_position_embeddings}")
    rows, max_len = max(rows, model.rows), max(max_len, model.max_seq_len)
    dtype, fp8 = model.numerics.dtype, model.numerics.official
    held = cache_bytes(cfg, model.rows, model.max_seq_len, dtype, fp8) if model.rows else 0
    if prefill_chunk is None:
        budget = CHUNK_BUDGET * max(0, available_bytes(model.device) - cache_bytes(cfg, rows, max_len, dtype, fp8))
        prefill_chunk = auto_prefill_chunk(cfg, longest, max_len, int(budget))
        if prefill_graphs:
            prefill_chunk = graph_chunk(prefill_chunk, longest)
    check_fits(cfg, rows, max_len, dtype, fp8, min(prefill_chunk or longest, longest), model.device, held,
               prefill_graphs)
    return prefill_chunk


def graph_chunk(chunk: int, longest: int, sizes: tuple = PREFILL_SIZES) -> int:
    """The prefill chunk when prefill graphs replay (the memory-sized `chunk`, 0 for whole prompts): the largest
    captured length within it (and within the longest prompt), so chunks at 0, C, 2C, ... reuse their graphs across
    prompts; a prompt's remainder runs eagerly. Where no captured length fits, `chunk` as it was (eager chunks)."""
    cap = min(chunk or longest, longest)
    fit = [s for s in sizes if s <= cap]
    return max(fit) if fit else chunk


def _runner(model: Transformer, slots: int, graphs: bool, pad_to_buckets: bool) -> DecodeRunner:
    """One runner per model, reused while the allocation, backend, slots and mode stay the same (graphs
    are captured once, not per call); kept by the engine beside the model (`engine.steps`)."""
    held = steps_of(model)
    r = held.get("decode")
    if r is None or not r.valid_for(model, slots, graphs, pad_to_buckets):
        r = held["decode"] = DecodeRunner(model, slots, graphs=graphs, pad_to_buckets=pad_to_buckets)
    return r


def _spec_step(model: Transformer, k: int, slots: int, graphs: bool, pad_to_buckets: bool) -> SpecStep:
    """One speculative step per model, reused and kept as `_runner`'s (its graphs are captured once)."""
    held = steps_of(model)
    r = held.get("speculative")
    if r is None or not r.valid_for(model, k, slots, graphs, pad_to_buckets):
        r = held["speculative"] = SpecStep(model, k, slots, graphs=graphs, pad_to_buckets=pad_to_buckets)
    return r


def _hit_stop(c: Completion, stops, decode_text) -> bool:
    tail = decode_text(c.token_ids[-16:])
    return any(s in tail for s in stops)


def _cut_at_stop(text: str, stops) -> str:
    cut = min((text.find(s) for s in stops if s in text), default=-1)
    return text[:cut] if cut >= 0 else text
