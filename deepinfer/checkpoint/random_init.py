"""How random V4 weights are drawn, for the embedded tiny model (`deepinfer.tiny`) and the benchmark presets
(`deepinfer.engine.random_weights`): one table of rules, scaled so activations stay O(1) through the layers
of an untrained model."""

from __future__ import annotations


def float_init(name: str, shape: tuple, dim: int) -> tuple[float, float]:
    """(std, mean) of the normal a float tensor `name` [shape] is drawn from, for model width `dim`."""
    last = name.rsplit(".", 1)[-1]
    if name == "embed.weight":
        return 1.0, 0.0
    if name == "head.weight" or name.endswith("gate.weight"):
        return dim**-0.5, 0.0  # variance 1/dim: logits / router scores O(1)
    if name.endswith("norm.weight"):
        return 0.1, 1.0
    if last.endswith("_fn"):  # hc_attn_fn, hc_ffn_fn, hc_head_fn
        return 0.02, 0.0
    if last.endswith("_base") or name.endswith("gate.bias"):
        return 0.1, 0.0
    if last.endswith("_scale"):
        return 0.05, 1.0
    if last == "ape":
        return 0.5, 0.0
    if last == "attn_sink":
        return 1.0, 0.0
    if len(shape) == 2:  # any other linear (compressor wkv/wgate, indexer weights_proj): variance 1/fan_in
        return shape[1] ** -0.5, 0.0
    raise AssertionError(f"no init rule for {name}")
