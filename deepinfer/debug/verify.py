"""`deepinfer verify --against transformers`: our `exact` numerics in float32 against transformers'
`DeepseekV4ForCausalLM` on the same checkpoint tensors, tensor by tensor (`compare`) and position by position
(`margin`), with one verdict.

Both run the prompt and the same decode steps (transformers teacher-forced on our greedy tokens, so the
positions line up); both dumps are written (atomically) to a directory and compared with the default
tolerances of `compare` for float32 (names present on one side only are listed, not failed: transformers
has no seam for the attention's inner taps, `deepinfer.debug.hf_dump.MISSING_TAPS`).

Known differences between transformers (5.24) and the official code, named when they apply:
* RoPE: transformers multiplies cos / sin by YaRN's mscale (0.1 ln(factor) + 1: 1.277 at factor 16) when a
  YaRN rope dict has no `attention_factor`; the official code never scales them.
* the indexer's top-k: `torch.topk` breaks exact ties at the k-th score in an unspecified order; ours keeps
  the lowest index.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch


@dataclass
class VerifyResult:
    passed: bool
    compare_line: str
    margin_verdict: str
    first_divergence: str | None
    max_logits_rel_err: float
    notes: list[str] = field(default_factory=list)
    ours: str = ""
    theirs: str = ""

    def line(self) -> str:
        v = "PASS" if self.passed else "FAIL"
        fd = f"; first divergence {self.first_divergence}" if self.first_divergence else ""
        return (f"verify against transformers: {v} (compare: {self.compare_line}; margin: {self.margin_verdict}, "
                f"logits rel_err up to {self.max_logits_rel_err:.2e}{fd})")


def known_differences(hf_config) -> list[str]:
    """The known transformers-vs-official differences this transformers config triggers."""
    notes = []
    rp = getattr(hf_config, "rope_parameters", None) or {}
    dicts = [rp] + [v for v in rp.values() if isinstance(v, dict)] if isinstance(rp, dict) else []
    for d in dicts:
        if d.get("rope_type") == "yarn" and d.get("attention_factor") is None and d.get("factor"):
            ms = 0.1 * math.log(float(d["factor"])) + 1.0
            notes.append(f"transformers scales RoPE cos/sin by YaRN's mscale {ms:.3f} (a yarn rope dict without "
                         "attention_factor); the official code does not")
            break
    return notes


def verify(model_dir: str | None, prompt_ids: list[int], steps: int, out_dir: str, device: str = "cpu",
           progress: bool = False) -> VerifyResult:
    """Dump both engines to `out_dir` (ours.h5, transformers.h5), compare them, measure the margins."""
    from deepinfer.debug.compare import compare_dumps
    from deepinfer.debug.dumper import run_dump, save
    from deepinfer.debug.hf_dump import run_hf_dump
    from deepinfer.debug.margin import measure
    from deepinfer.engine.loader import build_model, load_checkpoint, resolve_device, resolve_numerics
    from deepinfer.hf.model import build_hf_peer, require_transformers
    from deepinfer.ops import ops
    from deepinfer.outpath import check_output_dir

    require_transformers()
    dev = resolve_device(device)  # before the folder is made: a bad device leaves nothing behind
    check_output_dir(out_dir, "--out-dir")
    ops.configure("torch")
    num = resolve_numerics("exact", "float32")
    cfg, state, _, _ = load_checkpoint(model_dir, dev, progress, numerics=num)  # read once: both engines hold it
    run = run_dump(build_model(cfg, state, num, dev), prompt_ids, steps)
    ours = os.path.join(out_dir, "ours.h5")
    save(run, ours, {"engine": "deepinfer", "numerics": "exact", "dtype": "float32"})
    ours_logits = [t for n, t in run.records if n.endswith("logits")]
    hf = build_hf_peer(cfg, state, dev, dtype=torch.float32)
    del state
    hrun = run_hf_dump(hf, prompt_ids, steps, force_tokens=run.tokens)
    theirs = os.path.join(out_dir, "transformers.h5")
    save(hrun, theirs, {"engine": "transformers", "numerics": "exact", "dtype": "float32"})
    their_logits = [t for n, t in hrun.records if n.endswith("logits")]
    rep = compare_dumps(ours, theirs)
    # position i: the prompt's last logits (i = 0), then each decode step's
    ref = [their_logits[0][-1]] + [t[-1] for t in their_logits[1:]]
    test = [ours_logits[0][-1]] + [t[-1] for t in ours_logits[1:]]
    m = measure(ref, test, ref="transformers", test="deepinfer exact/float32", unit_roundoff=2.0 ** -24)
    fd = rep.first_divergence
    res = VerifyResult(rep.passed and m.verdict != "divergent", rep.first_line(), m.verdict,
                       None if fd is None else fd.name, max(p.logits_rel_err for p in m.positions),
                       known_differences(hf.config), ours, theirs)
    return res
