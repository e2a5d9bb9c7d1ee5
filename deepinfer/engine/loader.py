"""Model directory -> (config, validated weights, Transformer, tokenizer).

No `--model` means the embedded `deepinfer-tiny`, created on first use in the user cache and then loaded
through exactly the same path as a real checkpoint.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from deepinfer.checkpoint import load_state, mtp_layers_present, open_checkpoint
from deepinfer.config import ModelConfig, load_config
from deepinfer.engine.schedule import Schedule
from deepinfer.model.transformer import Transformer
from deepinfer.model.weights import DTYPES, NUMERICS, Numerics
from deepinfer.tokenizer import V4Tokenizer


class OptionError(ValueError):
    """A bad command-line value; the message names the option."""


@dataclass
class LoadedModel:
    cfg: ModelConfig
    model: Transformer
    tokenizer: V4Tokenizer
    model_dir: str
    layout: str


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise OptionError(f"--device {device!r}: not a device (cpu, cuda, cuda:N)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise OptionError(f"--device {device}: CUDA is not available on this machine")
    return dev


def resolve_numerics(numerics: str, dtype: str) -> Numerics:
    if numerics not in NUMERICS:
        raise OptionError(f"--numerics {numerics!r}: choose {' or '.join(NUMERICS)}")
    if dtype not in DTYPES:
        raise OptionError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    return Numerics(numerics, DTYPES[dtype])


def resolve_model_dir(model: str | None, progress: bool = True) -> str:
    if model in (None, "", "deepinfer-tiny"):
        from deepinfer.tiny import ensure_tiny_model

        return ensure_tiny_model(progress=progress)
    if not os.path.isdir(model):
        raise OptionError(f"--model {model}: no such directory")
    return model


def load_checkpoint(model: str | None, device: torch.device, progress: bool = True,
                    expert_range: tuple[int, int] | None = None) -> tuple[ModelConfig, dict, str, str]:
    """Open and validate a checkpoint (None: deepinfer-tiny) and read its tensors onto `device` ->
    (cfg, official-format state, model directory, layout). A transformers-layout checkpoint without the
    MTP block gets a config without it (transformers drops MTP)."""
    model_dir = resolve_model_dir(model, progress)
    ckpt = open_checkpoint(model_dir)
    cfg = load_config(model_dir)
    if cfg.n_mtp_layers and mtp_layers_present(ckpt) == 0 and ckpt.layout == "transformers":
        cfg = cfg.replace(n_mtp_layers=0, attn_kinds=cfg.attn_kinds[:cfg.n_layers],
                          compress_ratios=cfg.compress_ratios[:cfg.n_layers])
    if model in (None, "", "deepinfer-tiny"):
        cfg = cfg.replace(name="deepinfer-tiny")
    state = load_state(ckpt, cfg, device, progress=progress, expert_range=expert_range)
    return cfg, state, model_dir, ckpt.layout


def build_model(cfg: ModelConfig, state: dict, numerics: Numerics, device,
                expert_range: tuple[int, int] | None = None) -> Transformer:
    """The model over `state` (its tensors are used, not copied), with the engine's decode plan."""
    net = Transformer(cfg, state, numerics, device, expert_range=expert_range)
    net.schedule = Schedule()
    return net


def load_model(model: str | None = None, numerics: str = "official", dtype: str = "bfloat16",
               device: str | None = None, progress: bool = True,
               expert_range: tuple[int, int] | None = None) -> LoadedModel:
    """Open, validate and load a checkpoint; build the model for `numerics`/`dtype` on `device`.

    `expert_range` (lo, hi): hold (and read) only routed experts lo..hi-1 (expert parallelism)."""
    num = resolve_numerics(numerics, dtype)
    dev = resolve_device(device)
    cfg, state, model_dir, layout = load_checkpoint(model, dev, progress, expert_range)
    net = build_model(cfg, state, num, dev, expert_range)
    del state
    return LoadedModel(cfg, net, V4Tokenizer.from_model_dir(model_dir), model_dir, layout)
