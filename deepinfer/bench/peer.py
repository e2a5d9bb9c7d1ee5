"""The transformers peer of `deepinfer bench --peer transformers`: transformers' `DeepseekV4ForCausalLM` (bf16,
eager attention, built by `deepinfer.hf.model.build_hf_peer` with the engine's weights) timed on the same device
and the same prompts (`deepinfer.bench.workload.random_prompts`), so its ms/step sits next to the engine's."""

from __future__ import annotations

import os
import time

import torch

from deepinfer.bench.rates import sync
from deepinfer.bench.workload import WARMUP_STEPS, random_prompts
from deepinfer.config import ModelConfig
from deepinfer.hf.model import PeerError, build_hf_peer, peer_bytes, require_transformers


@torch.no_grad()
def time_hf_decode(hf, cfg: ModelConfig, B: int, P: int, K: int, device, seed: int) -> dict:
    """transformers: prefill B x P in one call, then K single-token steps with its own cache."""
    import inspect

    # transformers renamed `past_key_values` to `cache`; an unknown keyword would be swallowed by
    # **kwargs and every step would silently run without its cache
    key = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    ids = random_prompts(cfg, B, P, seed + 1).to(device)
    steps = random_prompts(cfg, (WARMUP_STEPS + K) * B, 1, seed + 2).view(WARMUP_STEPS + K, B, 1).to(device)
    out = hf(input_ids=ids, use_cache=True, logits_to_keep=1)
    cache = getattr(out, key, None)
    if cache is None:
        raise PeerError(f"transformers returned no `{key}` after the prefill")
    for s in range(WARMUP_STEPS):
        hf(input_ids=steps[s], use_cache=True, **{key: cache})
    sync(device)
    t = time.perf_counter()
    for s in range(WARMUP_STEPS, WARMUP_STEPS + K):
        hf(input_ids=steps[s], use_cache=True, **{key: cache})
    sync(device)
    dt = (time.perf_counter() - t) / K
    return {"batch": B, "ms_per_step": dt * 1e3, "tokens_per_s": B / dt}


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def run_peer(cfg: ModelConfig, state: dict, device, batches: list[int], P: int, K: int, seed: int,
             ours: dict) -> dict:
    """Time transformers at batch 1 and the largest batch; every failure becomes `{"error": ...}`."""
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the engine's freed caches would otherwise not count as free
    need, free = peer_bytes(cfg), _free_bytes(device)
    res = {"name": "transformers DeepseekV4ForCausalLM (bf16, eager)", "weight_bytes": need}
    try:
        res["version"] = require_transformers().__version__
    except PeerError as e:
        return {**res, "error": str(e)}
    if need > 0.9 * free:
        return {**res, "error": f"does not fit: needs {need / 2**30:.1f} GiB of bf16 weights, "
                                f"{free / 2**30:.1f} GiB free on {device}"}
    hf = None
    try:
        t = time.perf_counter()
        hf = build_hf_peer(cfg, state, device)
        sync(device)
        res["build_s"] = time.perf_counter() - t
        res["decode"] = []
        for B in sorted({min(batches), max(batches)}):
            r = time_hf_decode(hf, cfg, B, P, K, device, seed)
            if B in ours:
                r["speedup_ours"] = r["ms_per_step"] / ours[B]  # >1: DeepInfer is faster
            res["decode"].append(r)
    except Exception as e:  # OOM, an API change, a shape mismatch: report it, never hide it
        res["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    finally:
        del hf
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return res
