"""Continuous batching over a fixed set of cache rows (slots).

Requests (prompt token ids + their own `SamplingParams`) wait in a FIFO queue. `max_batch` slots = cache
rows = the most sequences decoding at once; the model is allocated with `max_batch + 1` rows, the last
one being the `DecodeRunner`'s spare row for bucket padding. Each step:

1. admit and prefill: while a slot is free and a request waits, it takes the slot; then prompts in their
   slots are prefilled FIFO. With `prefill_chunk` = C > 0 a step prefills at most C prompt tokens in all
   (a long prompt continues over several steps, `Transformer.prefill(start=...)`), so the running
   sequences keep decoding between a long prompt's chunks; C = 0 prefills each prompt whole;
2. sample: one `sample` / `logprobs` call over every sequence that has fresh logits (just-prefilled and
   running alike) with per-row temperature / top_k / top_p / seed / position tensors;
3. finish: a sequence ends on EOS, a stop string or `max_new_tokens` and frees its slot at once (the
   next step admits a waiting request into it);
4. decode: the running sequences together, one token each at their own positions, through the runner.

Guided decoding (`engine.guided`): a request whose params carry a `guide` gets an xgrammar matcher. Its
mask for the next sampling point is filled on the host right after the decode step is launched (the
matcher has already accepted the token that step consumes), so on CUDA the fill overlaps the step;
just-prefilled rows are filled after their prefill. When any row of a sampling call is constrained, the
bitmask (all ones for the unconstrained rows) is copied into a fixed device buffer and applied by the
`apply_token_bitmask` op before `sample` and `logprobs`; each matcher then accepts its sampled token. A
constrained row also finishes when its matcher has terminated (it accepted EOS where the grammar may end).

Determinism: the `sample` op's noise is a hash of (seed, position, token id); a request's seed is
`params.seed * 1_000_003 + index` (index = its place in the submitted list), never its slot, so the same
seeds and inputs give the same tokens whatever the batch composition or admission order.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from deepinfer.engine.runner import DecodeRunner
from deepinfer.ops import ops


@dataclass
class Request:
    index: int  # place in the submitted list: the seed offset and the result order
    input_ids: list[int]
    params: object  # SamplingParams
    completion: object  # Completion
    slot: int = -1
    position: int = 0  # position of the next token to sample (and then to decode)
    prefilled: int = 0  # prompt tokens already in the cache (chunked prefill)
    matcher: object = None  # guided decoding: the xgrammar matcher (None: unconstrained)

    @property
    def seed(self) -> int:
        return self.params.seed * 1_000_003 + self.index


@dataclass
class SchedulerStats:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_tokens: int = 0  # tokens fed through decode steps (live rows, padding excluded)
    decode_steps: int = 0
    prefills: int = 0  # prompts completely prefilled
    prefill_calls: int = 0  # model.prefill calls (one per chunk)
    max_running: int = 0


class Scheduler:
    """Continuous batching over `max_batch` slots (rows 0 .. max_batch - 1; default `runner.max_batch`).

    record(completion, token, logprob_row, logit_row, n_top) and finished(request) -> reason | "" are the
    generate loop's bookkeeping hooks (kept there so `Completion` stays defined in one place).
    """

    def __init__(self, model, runner: DecodeRunner, eos_id: int, record, stop_check, max_batch: int | None = None,
                 prefill_chunk: int = 0, prefill=None):
        """prefill: what runs a prompt chunk, `Transformer.prefill`'s contract (default the model's own; the
        engine's `PrefillRunner` replays captured chunks)."""
        if prefill_chunk < 0:
            raise ValueError(f"prefill_chunk {prefill_chunk}: must be >= 0 (0: whole prompts)")
        self.prefill_chunk = prefill_chunk
        self.model, self.runner, self.eos_id = model, runner, eos_id
        self._prefill = prefill  # None: the model's own, looked up at each call
        self.record, self.stop_check = record, stop_check
        self.max_batch = runner.max_batch if max_batch is None else max_batch
        if not 1 <= self.max_batch <= runner.max_batch:
            raise ValueError(f"max_batch {self.max_batch}: the runner serves 1 .. {runner.max_batch} rows")
        self.waiting: deque[Request] = deque()
        self.free = list(range(self.max_batch - 1, -1, -1))  # pop() hands out the lowest slot first
        self.running: list[Request] = []
        self.prefilling: deque[Request] = deque()  # hold a slot, prompt (partly) not yet in the cache
        self.stats = SchedulerStats()
        self.masks = None  # guided decoding: engine.guided.MaskBuffer, made when a constrained request comes

    def submit(self, req: Request) -> None:
        need = len(req.input_ids) + req.params.max_new_tokens
        if need > self.model.max_seq_len:
            raise ValueError(f"request {req.index}: {len(req.input_ids)} prompt + {req.params.max_new_tokens} new "
                             f"tokens exceed the cache's max_seq_len {self.model.max_seq_len}")
        guide = getattr(req.params, "guide", None)
        if guide is not None:
            from deepinfer.engine.guided import MaskBuffer

            req.matcher = guide.matcher()
            if self.masks is None:
                self.masks = MaskBuffer(self.max_batch, self.model.cfg.vocab_size, self.model.device)
        self.waiting.append(req)

    # ------------------------------------------------------------------------------------------
    def _sync(self) -> None:
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)

    def _admit(self) -> list[tuple[Request, torch.Tensor]]:
        """Hand free slots to waiting requests, then prefill (at most `prefill_chunk` tokens this step,
        whole prompts if 0) -> [(request whose prompt is now complete, its last logits [V])]."""
        while self.waiting and self.free:
            req = self.waiting.popleft()
            req.slot = self.free.pop()
            self.prefilling.append(req)
        out = []
        if not self.prefilling:
            return out
        dev = self.model.device
        self._sync()
        t0 = time.perf_counter()
        budget = self.prefill_chunk or None
        while self.prefilling and (budget is None or budget > 0):
            req = self.prefilling[0]
            n = len(req.input_ids)
            c = n - req.prefilled if budget is None else min(budget, n - req.prefilled)
            ids = torch.tensor([req.input_ids[req.prefilled:req.prefilled + c]], dtype=torch.long, device=dev)
            logits, streams = (self._prefill or self.model.prefill)(ids, rows=torch.tensor([req.slot], device=dev), start=req.prefilled)
            self.on_prefill(req, req.prefilled, ids, streams)
            req.prefilled += c
            self.stats.prefill_calls += 1
            if budget is not None:
                budget -= c
            if req.prefilled == n:
                self.prefilling.popleft()
                req.position = n
                out.append((req, logits[0, -1]))
                self.stats.prefills += 1
        self._sync()
        self.stats.prefill_s += time.perf_counter() - t0
        return out

    def _fill_masks(self, reqs: list[Request], start: int = 0) -> None:
        """Host bitmask rows start .. len(reqs) - 1 for the next sampling point of reqs[start:]."""
        if self.masks is not None and start < len(reqs):
            self.masks.fill([r.matcher for r in reqs[start:]], start)

    def on_prefill(self, req: Request, start: int, ids: torch.Tensor, streams: torch.Tensor) -> None:
        """A prompt chunk ids [1, c] at positions start .. start + c - 1 was prefilled into the request's slot,
        streams [1, c, hc, D] the main model's output there (speculative decoding feeds its MTP block)."""

    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> list[int]:
        dev = logits.device
        guided = self.masks is not None and any(r.matcher is not None for r in reqs)
        if guided:  # before temperature / top-k / top-p and logprobs: a masked token is never drawn
            logits = ops.apply_token_bitmask(logits, self.masks.to_device(len(reqs)))
        p = [r.params for r in reqs]
        temp = torch.tensor([x.temperature for x in p], dtype=torch.float32, device=dev)
        top_k = torch.tensor([x.top_k for x in p], dtype=torch.long, device=dev)
        top_p = torch.tensor([x.top_p for x in p], dtype=torch.float32, device=dev)
        seeds = torch.tensor([r.seed for r in reqs], dtype=torch.long, device=dev)
        pos = torch.tensor([r.position for r in reqs], dtype=torch.long, device=dev)
        toks = ops.sample(logits, temp, top_k, top_p, seeds, pos)
        lps = ops.logprobs(logits)
        toks_l = toks.tolist()
        for j, r in enumerate(reqs):
            if r.matcher is not None and not r.matcher.accept_token(toks_l[j]):
                raise RuntimeError(f"request {r.index}: the grammar matcher refused token {toks_l[j]}, which the "
                                   "mask allowed")
            self.record(r.completion, toks_l[j], lps[j], logits[j], r.params.logprobs)
        return toks_l

    def _finish_reason(self, r: Request, tok: int) -> str:
        c, p = r.completion, r.params
        if r.matcher is not None and r.matcher.is_terminated():
            return "eos"
        if tok == self.eos_id and not p.ignore_eos:
            return "eos"
        if len(c.token_ids) >= p.max_new_tokens:
            return "length"
        if p.stop and self.stop_check(c, p.stop):
            return "stop"
        return ""

    def run(self) -> SchedulerStats:
        """Run until every submitted request has finished."""
        dev = self.model.device
        t_start = time.perf_counter()
        pending: list[Request] = []  # running requests whose decode logits are in `dec_logits`
        dec_logits = None
        while self.waiting or self.running or self.prefilling:
            admitted = self._admit()
            reqs = pending + [r for r, _ in admitted]
            if not reqs:  # a long prompt is still mid-prefill and nothing else runs
                continue
            self._fill_masks(reqs, len(pending))  # the pending rows' masks were filled during their decode
            rows = ([dec_logits] if pending else []) + [lg.unsqueeze(0) for _, lg in admitted]
            logits = torch.cat(rows) if len(rows) > 1 else rows[0]
            toks = self._sample(reqs, logits)
            self.running = []
            next_toks = []
            for r, t in zip(reqs, toks):
                reason = self._finish_reason(r, t)
                if reason:
                    r.completion.finish_reason = reason
                    if r.matcher is not None:
                        from deepinfer.engine.guided import status

                        r.completion.constraint = {**r.params.guide.constraint.describe(), **status(r.matcher, reason)}
                    self.free.append(r.slot)  # freed now: the next step can admit into it
                    r.slot = -1
                else:
                    self.running.append(r)
                    next_toks.append(t)
            self.free.sort(reverse=True)
            if not self.running:
                pending, dec_logits = [], None
                continue
            n = len(self.running)
            self.stats.max_running = max(self.stats.max_running, n)
            ids = torch.tensor(next_toks, dtype=torch.long, device=dev).view(n, 1)
            pos = torch.tensor([r.position for r in self.running], dtype=torch.long, device=dev)
            slots = torch.tensor([r.slot for r in self.running], dtype=torch.long, device=dev)
            dec_logits = self.runner.decode(ids, pos, slots)
            self._fill_masks(self.running)  # on the host while the device runs the step
            for r in self.running:
                r.position += 1
            pending = list(self.running)
            self.stats.decode_tokens += n
            self.stats.decode_steps += 1
        self._sync()
        self.stats.decode_s = time.perf_counter() - t_start - self.stats.prefill_s
        return self.stats
