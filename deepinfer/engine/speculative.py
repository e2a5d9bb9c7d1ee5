"""MTP speculative decoding: K draft tokens per step from the MTP block, verified in one batched forward.

Per running row b, between steps: the main model's caches hold positions < p (p = `Request.position`),
x_p is the token just emitted (not yet in the caches), the MTP block's cache holds positions < p too (MTP
position t reads the main model's streams h_t and emb(x_{t+1})), and the row carries the MTP block's logits
and output streams at position p - 1 (from its input (h_{p-1}, x_p)): the first draft's distribution.
One step (`SpecStep`, all rows at once, nothing read from the host):

1. drafts: d_1 ~ q_1 from those logits; for j < K the MTP block runs again at position p + j - 1 on its own
   output streams and emb(d_j) (reused for each further draft, as vLLM and SGLang do) -> q_{j+1}, d_{j+1}.
   These steps commit into the MTP cache so that the next draft attends them, and are rolled back
   afterwards (`verify.Snapshot`);
2. verify: the main model over [x_p, d_1 .. d_K] at positions p .. p + K, writing no cache
   (`Transformer.verify`) -> target distributions p_0 .. p_K;
3. accept (`ops.spec_verify`): greedy rows accept while the draft is the argmax; sampled rows by rejection
   sampling (accept with min(1, p/q), else draw from the normalised max(0, p - q); the bonus token from p_K
   when all K are accepted), uniforms and noise hashed from (seed, position) -> n accepted, the next token;
4. commit: the main caches keep positions p .. p + n (`Transformer.commit`); every trace of the rest is
   gone by construction (they were never written);
5. the MTP block over positions p .. p + K on the verify's streams and the tokens x_{p+1} .. x_{p+n+1},
   committing p .. p + n: its cache catches up, and its logits at p + n are the next step's first draft.

After prefill the MTP block runs over the prompt (`mtp_prefill`, chunk by chunk with the prompt; the
last position once the first token is sampled). Emitted per row and step: d_1 .. d_n and the next token
(n + 1 tokens), cut at EOS, a stop string or max_new_tokens like plain decoding.
"""

from __future__ import annotations

import time

import torch

from deepinfer.engine.graphs import GraphedStep, StepGraphs
from deepinfer.engine.scheduler import Scheduler
from deepinfer.model.spec_verify import Snapshot
from deepinfer.ops import ops
from deepinfer.ops.reference import DRAFT_SEED_SALT


def check_speculate(model, k: int) -> None:
    """Refuse a speculation the model cannot run: no MTP block, K < 1, or K + 1 tokens beyond what the
    sliding window's ring holds at once (verify's kept tokens must land in distinct ring slots)."""
    if not model.mtp:
        raise ValueError("--speculate: this checkpoint has no MTP block (mtp.0.*); speculative decoding needs one")
    win = model.cfg.window_size
    if not 1 <= k <= win - 1:
        raise ValueError(f"--speculate {k}: must be between 1 and {win - 1} (the sliding window of {win} tokens "
                         "holds the K + 1 tokens a step verifies)")


class SpecStep(GraphedStep):
    """One speculative step of a batch (the module docstring's 1-5), eager or bucketed into CUDA graphs like
    `DecodeRunner` (the spare row, the model's last, takes the padding entries and the dropped tokens)."""

    def __init__(self, model, k: int, max_batch: int, graphs: bool = False, pad_to_buckets: bool = False,
                 warmup_iters: int = 2):
        check_speculate(model, k)
        super().__init__(model, max_batch, graphs, pad_to_buckets)
        self.k = k
        if model.rows < max_batch + 1:
            raise ValueError(f"speculative decoding needs {max_batch + 1} cache rows (max_batch + 1 spare); "
                             f"the model has {model.rows}")
        self.spare = model.rows - 1
        self.steps = StepGraphs("speculative step", max_batch, self._inputs(), model.device, self.graphs,
                                self.lanes, warmup_iters) if self.bucketed else None

    def valid_for(self, model, k: int, max_batch: int, graphs: bool, pad_to_buckets: bool = False) -> bool:
        return (self.same_build(model, graphs) and k == self.k and max_batch == self.max_batch
                and (self.graphs or pad_to_buckets == self.bucketed))

    # ------------------------------------------------------------------------------------------
    def forward(self, tokens, positions, rows, mtp_logits, mtp_h, temp, top_k, top_p, seeds) -> tuple:
        """tokens, positions, rows [n] int64 (x_p, p, cache row), mtp_logits [n, V] and mtp_h [n, hc, D] (the
        MTP block's at p - 1), temp / top_p [n] f32, top_k / seeds [n] int64 ->
        (n_acc [n], next token [n], drafts [n, K], target logits [n, K + 1, V], the MTP block's logits [n, V]
        and streams [n, hc, D] at the new p - 1): the new tokens are drafts[:n_acc] then the next token."""
        m, K = self.model, self.k
        n = tokens.size(0)
        ar = torch.arange(n, device=tokens.device)
        qs, ds = [], []
        lg, h = mtp_logits, mtp_h
        snap = Snapshot(m.mtp[0].block.attn, rows, positions, K - 1) if K > 1 else None
        one = torch.ones(n, dtype=torch.long, device=tokens.device)
        for j in range(K):  # draft j + 1, at position p + j + 1
            q, d = self.draft(lg, temp, top_k, top_p, seeds, positions + j + 1, rows)
            qs.append(q)
            ds.append(d)
            if j < K - 1:  # the MTP block again, at position p + j, on its own streams and the draft
                lgs, hs, ctx = m.mtp_verify(h.unsqueeze(1), ds[-1].view(n, 1), positions + j, rows)
                m.commit(ctx, one, self.spare)  # the next draft attends it; rolled back below
                lg, h = lgs[:, 0], hs[:, 0]
        if snap is not None:
            snap.restore()
        drafts, q = torch.stack(ds, 1), torch.stack(qs, 1)  # [n, K], [n, K, V]
        logits, streams, vctx = m.verify(torch.cat([tokens.view(n, 1), drafts], 1), positions, rows)
        V = logits.size(-1)
        rep = lambda t: t.repeat_interleave(K + 1)  # noqa: E731
        p = ops.spec_probs(logits.flatten(0, 1), rep(temp), rep(top_k), rep(top_p)).view(n, K + 1, V)
        n_acc, nxt = ops.spec_verify(p, q, drafts, seeds, positions + 1)
        m.commit(vctx, n_acc + 1, self.spare)
        # the MTP block catches up over p .. p + n (input x_{t+1} at t: the accepted drafts, then the new token)
        next_ids = torch.cat([drafts, nxt.view(n, 1)], 1).scatter(1, n_acc.view(n, 1), nxt.view(n, 1))
        mlg, mh, mctx = m.mtp_verify(streams, next_ids, positions, rows)
        m.commit(mctx, n_acc + 1, self.spare)
        return n_acc, nxt, drafts, logits, mlg[ar, n_acc], mh[ar, n_acc]

    def draft(self, logits, temp, top_k, top_p, seeds, pos, rows) -> tuple[torch.Tensor, torch.Tensor]:
        """A draft token from the MTP block's logits [n, V] for position pos [n] -> (its distribution q [n, V],
        the token [n] drawn from q with noise of its own). Tests replace it (an oracle drafter) to exercise
        acceptance, which random weights rarely give."""
        q = ops.spec_probs(logits, temp, top_k, top_p)
        return q, ops.sample(logits, temp, top_k, top_p, seeds + DRAFT_SEED_SALT, pos)

    # ------------------------------------------------------------------------------------------
    _INPUTS = ("tokens", "positions", "rows", "mtp_logits", "mtp_h", "temp", "top_k", "top_p", "seeds")

    def _inputs(self) -> dict:
        """The step's inputs for `StepGraphs`: name -> (tail shape, dtype, padding: token 0 at position 0 of
        the spare row, greedy)."""
        cfg, dt = self.model.cfg, self.model.numerics.dtype
        return {"tokens": ((), torch.long, 0), "positions": ((), torch.long, 0), "rows": ((), torch.long, self.spare),
                "mtp_logits": ((cfg.vocab_size,), torch.float32, 0), "mtp_h": ((cfg.hc_mult, cfg.dim), dt, 0),
                "temp": ((), torch.float32, 0), "top_k": ((), torch.long, 0), "top_p": ((), torch.float32, 1),
                "seeds": ((), torch.long, 0)}

    def bucket_for(self, n: int) -> int:
        return self.steps.bucket_for(n)

    def capture(self) -> None:
        """Warm up and capture every bucket's step (largest first, one pool). No-op unless graphs."""
        if self.graphs:
            self.steps.capture(self.forward)

    @torch.inference_mode()
    def __call__(self, *args) -> tuple:
        """`forward` on the live batch (args as `forward`'s, n rows): eager, bucketed, or a graph replay."""
        if not self.bucketed:
            with self.lanes.issuing():
                return self.forward(*args)
        if self.model.rope is not self._allocation:
            raise RuntimeError("the model was re-allocated after this SpecStep was built: make a new one")
        return self.steps.run(self.forward, dict(zip(self._INPUTS, args)))


class SpecScheduler(Scheduler):
    """`Scheduler` with speculative steps instead of decode steps (same admission, prefill, first token,
    finish rules); `step` is a `SpecStep`. Per completion it counts the steps, drafted and accepted tokens."""

    def __init__(self, model, step: SpecStep, eos_id: int, record, stop_check, max_batch: int | None = None,
                 prefill_chunk: int = 0, prefill=None):
        super().__init__(model, step, eos_id, record, stop_check, max_batch, prefill_chunk, prefill)
        self.step = step

    def on_prefill(self, req, start: int, ids: torch.Tensor, streams: torch.Tensor) -> None:
        """A prompt chunk at positions start .. start + c - 1 was prefilled: the MTP block over it, but for its
        last position when that is the prompt's last (its input token is the first sampled one: `_first`)."""
        n, c = len(req.input_ids), ids.size(1)
        dev = self.model.device
        row = torch.tensor([req.slot], device=dev)
        last = start + c == n
        m = c - 1 if last else c  # positions whose next token is a prompt token
        if m:
            nxt = torch.tensor([req.input_ids[start + 1:start + 1 + m]], dtype=torch.long, device=dev)
            self.model.mtp_prefill(streams[:, :m], nxt, rows=row, start=start)
        if last:
            req.mtp_pending = (streams[:, c - 1:c], start + c - 1)

    def _first(self, req, tok: int) -> None:
        """The MTP block at the prompt's last position, input (h, first token): the first draft's logits."""
        h, pos = req.mtp_pending
        req.mtp_pending = None
        dev = self.model.device
        lg, mh = self.model.mtp_prefill(h, torch.tensor([[tok]], device=dev), rows=torch.tensor([req.slot], device=dev),
                                        start=pos, with_streams=True)
        req.mtp_logits, req.mtp_h, req.token = lg[0, -1], mh[0, -1], tok

    def _finish(self, r, reason: str) -> None:
        r.completion.finish_reason = reason
        self.free.append(r.slot)
        r.slot = -1

    def run(self):
        dev = self.model.device
        t_start = time.perf_counter()
        K = self.step.k
        while self.waiting or self.running or self.prefilling:
            admitted = self._admit()
            if admitted:
                reqs = [r for r, _ in admitted]
                toks = self._sample(reqs, torch.stack([lg for _, lg in admitted]))
                for r, t in zip(reqs, toks):
                    reason = self._finish_reason(r, t)
                    if reason:
                        self._finish(r, reason)
                    else:
                        self._first(r, t)
                        self.running.append(r)
                self.free.sort(reverse=True)
            if not self.running:
                continue
            run = self.running
            n = len(run)
            self.stats.max_running = max(self.stats.max_running, n)
            lt = lambda xs, dt=torch.long: torch.tensor(xs, dtype=dt, device=dev)  # noqa: E731
            p = [r.params for r in run]
            n_acc, nxt, drafts, logits, mlg, mh = self.step(
                lt([r.token for r in run]), lt([r.position for r in run]), lt([r.slot for r in run]),
                torch.stack([r.mtp_logits for r in run]), torch.stack([r.mtp_h for r in run]),
                lt([x.temperature for x in p], torch.float32), lt([x.top_k for x in p]),
                lt([x.top_p for x in p], torch.float32), lt([r.seed for r in run]))
            lps = ops.logprobs(logits.flatten(0, 1)).view(n, K + 1, -1)
            n_l, nxt_l, d_l = n_acc.tolist(), nxt.tolist(), drafts.tolist()
            self.running = []
            for b, r in enumerate(run):
                c = r.completion
                c.spec_steps += 1
                c.spec_drafted += K
                c.spec_accepted += n_l[b]
                reason = ""
                for i, t in enumerate(d_l[b][:n_l[b]] + [nxt_l[b]]):
                    self.record(c, t, lps[b, i], logits[b, i], r.params.logprobs)
                    self.stats.decode_tokens += 1
                    reason = self._finish_reason(r, t)
                    if reason:
                        break
                if reason:
                    self._finish(r, reason)
                else:
                    r.position += n_l[b] + 1
                    r.token, r.mtp_logits, r.mtp_h = nxt_l[b], mlg[b], mh[b]
                    self.running.append(r)
            self.free.sort(reverse=True)
            self.stats.decode_steps += 1
        self._sync()
        self.stats.decode_s = time.perf_counter() - t_start - self.stats.prefill_s
        return self.stats
