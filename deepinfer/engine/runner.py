"""The decode step: eager, or CUDA graphs captured per batch-size bucket.

`DecodeRunner.decode(input_ids [n, 1], positions [n], rows [n]) -> logits [n, V] float32`.

* eager (default): calls `model.decode` on the live batch as it is.
* graphs (CUDA only): the step captured per bucket b in 1, 2, 4, ..., up to `max_batch` (and `max_batch`
  itself when it is not a power of two), replayed from the smallest bucket >= n (`engine.graphs.StepGraphs`).
* padding: the remaining b - n entries decode token 0 at position 0 into a dedicated spare cache row
  (the model's last row: allocate `max_batch + 1` rows), so they never touch a live sequence; their
  logits are ignored. Warm-up and capture also run only on the spare row.
* `pad_to_buckets=True` without graphs runs the same bucket / padding / spare-row path eagerly (how the
  CPU tests check that padding does not change the live rows' logits).

The runner owns the step's execution: its graphs and the side streams (`Lanes`) the model's forks run on
(the model writes its order once and never sees either). Sampling and logprobs run outside the graph on its
output logits.

The graphs bake in the addresses of the model's caches: a runner belongs to one `model.allocate` (see
`valid_for`); re-allocating the model needs a new runner. It refers to its model weakly (`engine.steps`).
"""

from __future__ import annotations

import torch

from deepinfer.engine.graphs import GraphedStep, StepGraphs


class DecodeRunner(GraphedStep):
    """Owns the decode step of one model allocation.

    model: a `Transformer` allocated with at least `max_batch + 1` rows (the last one is the spare row).
    graphs: capture CUDA graphs (needs a CUDA model; ignored with a reason in `mode` otherwise).
    pad_to_buckets: bucket and pad like graph mode but run eagerly (testing / debugging).
    """

    def __init__(self, model, max_batch: int, graphs: bool = False, pad_to_buckets: bool = False,
                 warmup_iters: int = 2):
        super().__init__(model, max_batch, graphs, pad_to_buckets)
        if self.bucketed:
            if model.rows < max_batch + 1:
                raise ValueError(f"bucketed decode needs {max_batch + 1} cache rows (max_batch + 1 spare); "
                                 f"the model has {model.rows}")
            self.spare_row = model.rows - 1
            inputs = {"input_ids": ((), torch.long, 0), "positions": ((), torch.long, 0),
                      "rows": ((), torch.long, self.spare_row)}
            self.steps = StepGraphs("decode step", max_batch, inputs, model.device, self.graphs, self.lanes,
                                    warmup_iters)

    @property
    def mode(self) -> str:
        return "graphs" if self.graphs else "eager-bucketed" if self.bucketed else "eager"

    def valid_for(self, model, max_batch: int, graphs: bool, pad_to_buckets: bool = False) -> bool:
        """Can this runner serve these settings (same allocation, backend and mode; graphs: up to the
        captured max_batch, so a smaller batch does not re-capture; otherwise the same max_batch)?"""
        if not self.same_build(model, graphs):
            return False
        if self.graphs:
            return max_batch <= self.max_batch
        return max_batch == self.max_batch and pad_to_buckets == self.bucketed

    def bucket_for(self, n: int) -> int:
        return self.steps.bucket_for(n)

    def _step(self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The captured function: input_ids, positions, rows [b] -> logits [b, V]."""
        return self.model.decode(input_ids.view(-1, 1), positions, rows=rows)[:, -1]

    def capture(self) -> None:
        """Warm up and capture every bucket (largest first, one shared pool). No-op unless graphs."""
        if self.graphs:
            self.steps.capture(self._step)

    @torch.inference_mode()
    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """input_ids [n, 1] int64, positions [n], rows [n] (device tensors) -> logits [n, V] float32."""
        model = self.model
        if not self.bucketed:
            with self.lanes.issuing():
                return model.decode(input_ids.view(-1, 1), positions, rows=rows)[:, -1]
        if model.rope is not self._allocation:
            raise RuntimeError("the model was re-allocated after this DecodeRunner was built: make a new one")
        return self.steps.run(self._step, {"input_ids": input_ids, "positions": positions, "rows": rows})

