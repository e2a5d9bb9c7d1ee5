"""Dumps from transformers' `DeepseekV4ForCausalLM` under our tap names, so `compare` and `margin` work across
engines (`deepinfer dump --engine transformers`, `deepinfer verify`).

The model is built from the same checkpoint tensors (`deepinfer.hf.model.build_hf_peer`, dequantised: what
our `exact` numerics compute) and run with its own cache: the prompt, then greedy decode steps. Forward hooks
write, per layer L (decode steps under the `stepK.` prefix, as `deepinfer dump`):

| our tap | transformers                                                   |
| ---     | ---                                                            |
| `layers.L.hc_attn.in`            | `model.layers[L]` input streams [B, S, hc, D] |
| `layers.L.hc_attn.post`, `.comb` | `layers[L].attn_hc` outputs `post`, `comb` (same orientation: y = post x + combᵀ h) |
| `layers.L.attn.in`               | `layers[L].input_layernorm` output |
| `layers.L.attn.out`              | `layers[L].self_attn` output |
| `layers.L.hc_attn.out`, `layers.L.hc_ffn.in` | `layers[L].ffn_hc` input streams |
| `layers.L.hc_ffn.post`, `.comb`  | `layers[L].ffn_hc` outputs |
| `layers.L.ffn.in`                | `layers[L].post_attention_layernorm` output |
| `layers.L.ffn.out`               | `layers[L].mlp` output |
| `layers.L.hc_ffn.out`            | `model.layers[L]` output |
| `input_ids`, `logits`            | the call's input ids, its logits (float32) |

Not there (transformers computes them inside modules without a seam): `attn.q`, `attn.kv`, `attn.core`,
`attn.compressed_kv`, the indexer's taps and the router's (`ffn.router.*`). `compare` lists names present on
one side only.
"""

from __future__ import annotations

import inspect

import torch

from deepinfer.capture import capturing, set_prefix, tap
from deepinfer.debug.dumper import DumpRun, _unbatch, selection

MISSING_TAPS = ("attn.q", "attn.kv", "attn.core", "attn.compressed_kv", "attn.indexer.*", "ffn.router.*")


def _hooks(hf) -> list:
    """Register the forward hooks of the table above; returns their handles."""
    hs = []
    for L, layer in enumerate(hf.model.layers):
        n = f"layers.{L}"

        def pre(name):
            return lambda mod, args, kwargs: tap(name, args[0] if args else kwargs["hidden_states"])

        def post_comb(sub, n=n):
            def hook(mod, args, out):
                post, comb, _ = out
                tap(f"{n}.hc_{sub}.post", post)
                tap(f"{n}.hc_{sub}.comb", comb)
            return hook

        def out_tap(name):
            return lambda mod, args, out: tap(name, out[0] if isinstance(out, tuple) else out)

        hs.append(layer.register_forward_pre_hook(pre(f"{n}.hc_attn.in"), with_kwargs=True))
        hs.append(layer.attn_hc.register_forward_hook(post_comb("attn")))
        hs.append(layer.input_layernorm.register_forward_hook(out_tap(f"{n}.attn.in")))
        hs.append(layer.self_attn.register_forward_hook(out_tap(f"{n}.attn.out")))

        def ffn_in(mod, args, kwargs, n=n):
            h = args[0] if args else kwargs["hidden_streams"]
            tap(f"{n}.hc_attn.out", h)
            tap(f"{n}.hc_ffn.in", h)

        hs.append(layer.ffn_hc.register_forward_pre_hook(ffn_in, with_kwargs=True))
        hs.append(layer.ffn_hc.register_forward_hook(post_comb("ffn")))
        hs.append(layer.post_attention_layernorm.register_forward_hook(out_tap(f"{n}.ffn.in")))
        hs.append(layer.mlp.register_forward_hook(out_tap(f"{n}.ffn.out")))
        hs.append(layer.register_forward_hook(out_tap(f"{n}.hc_ffn.out")))
    return hs


@torch.inference_mode()
def run_hf_dump(hf, prompt_ids: list[int], steps: int = 0, layers: list[int] | None = None,
                force_tokens: list[int] | None = None) -> DumpRun:
    """`deepinfer.debug.dumper.run_dump` for a transformers model: prefill (all logits), `steps` greedy decode
    steps (or `force_tokens`) with its cache, taps under our names."""
    if not prompt_ids:
        raise ValueError("empty prompt: the prompt needs at least one token")
    dev = next(hf.parameters()).device
    key = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    run = DumpRun(list(prompt_ids), [])
    handles = _hooks(hf)
    try:
        with capturing(selection(layers)) as cap:
            set_prefix("")
            ids = torch.tensor([prompt_ids], device=dev)
            tap("input_ids", ids)
            out = hf(input_ids=ids, use_cache=True)
            tap("logits", out.logits.float())
            cache = getattr(out, key)
            pick = lambda row, i: int(force_tokens[i]) if force_tokens is not None and i < len(force_tokens) \
                else int(row.float().argmax())  # noqa: E731
            run.tokens.append(pick(out.logits[0, -1], 0))
            for k in range(1, steps + 1):
                set_prefix(f"step{k}.")
                tok = torch.tensor([[run.tokens[-1]]], device=dev)
                tap("input_ids", tok)
                out = hf(input_ids=tok, use_cache=True, **{key: cache})
                cache = getattr(out, key)
                tap("logits", out.logits.float())
                run.tokens.append(pick(out.logits[0, -1], k))
            set_prefix("")
    finally:
        for h in handles:
            h.remove()
    for name, t in cap.records:
        run.records.append((name, _unbatch(name, t)))
    return run
