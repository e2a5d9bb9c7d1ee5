"""`deepinfer-tiny`: the embedded default model, generated on first use and cached on disk.

Random weights for `tiny_config()` in the OFFICIAL quantised layout (FP8 dense linears with ue8m0
128x128 scales, FP4 routed experts with per-32 scales, bf16/fp32 floats, int32 `tid2eid`), so every
path of the real checkpoint (decode of scales, FP4 unpacking, hash routing, MTP) is exercised without a
download. Generation is deterministic (fixed seed, CPU generator, one stream per tensor name) and takes
about a second; the directory is written atomically, so concurrent first runs cannot corrupt it.
"""

from __future__ import annotations

import json
import os
import zlib

import torch

from deepinfer.checkpoint.reader import INDEX_NAME, CheckpointError, scale_name
from deepinfer.checkpoint.random_init import float_init
from deepinfer.checkpoint.schema import expected_tensors, fp32_in_release
from deepinfer.checkpoint.writer import write_checkpoint
from deepinfer.config import ModelConfig, tiny_config
from deepinfer.quant.formats import quant_fp4, quant_fp8_block

TINY_NAME = "deepinfer-tiny-v1"  # bump the suffix whenever the generated weights change
SEED = 20250424
# Two shards (embed + layers | head + MTP), so the cached model also exercises the sharded index path.
_MAX_SHARD_BYTES = 96 << 20


def tiny_model_dir() -> str:
    """Where the tiny model lives: $DEEPINFER_HOME/models, else $XDG_CACHE_HOME/deepinfer/models, else ~/.cache."""
    from deepinfer import settings

    if settings.path("DEEPINFER_HOME"):
        root = settings.path("DEEPINFER_HOME")
    elif os.environ.get("XDG_CACHE_HOME"):
        root = os.path.join(os.environ["XDG_CACHE_HOME"], "deepinfer")
    else:
        root = os.path.join(os.path.expanduser("~"), ".cache", "deepinfer")
    return os.path.join(root, "models", TINY_NAME)


def _where() -> str:
    """Which setting chose the tiny model's root, for an error line."""
    from deepinfer import settings

    if settings.path("DEEPINFER_HOME"):
        return "DEEPINFER_HOME"
    return "XDG_CACHE_HOME" if os.environ.get("XDG_CACHE_HOME") else "the home directory (~/.cache)"


def _check_home(d: str) -> None:
    """The tiny model's parent directory exists or can be created (made now, for real: root passes `os.access`
    where mkdir fails); else a ValueError naming the setting that chose it, before anything is generated."""
    parent = os.path.dirname(d)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{_where()}: cannot create {parent} for the tiny model ({e.strerror or e})") from None
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{_where()}: {parent} is not writable, so the tiny model cannot be created there")


def _complete(d: str) -> bool:
    """config.json present and every shard the index names present (our writes are all-or-nothing)."""
    try:
        with open(os.path.join(d, INDEX_NAME), encoding="utf-8") as f:
            shards = set(json.load(f)["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    return os.path.isfile(os.path.join(d, "config.json")) and all(os.path.isfile(os.path.join(d, s)) for s in shards)


def _gen(name: str) -> torch.Generator:
    # One stream per tensor: a tensor's values do not depend on which tensors come before it.
    return torch.Generator().manual_seed(SEED ^ zlib.crc32(name.encode()))


def _randn(shape: tuple, std: float, g: torch.Generator, mean: float = 0.0) -> torch.Tensor:
    return torch.randn(shape, generator=g) * std + mean


def tiny_tensors(cfg: ModelConfig | None = None) -> dict[str, torch.Tensor]:
    """All official-layout tensors for `cfg` (default tiny_config()), weights + uint8 ue8m0 scales."""
    cfg = cfg or tiny_config()
    specs = expected_tensors(cfg)
    out: dict[str, torch.Tensor] = {}
    to_quant: dict[tuple, list[tuple[str, torch.Tensor]]] = {}  # (kind, shape) -> [(name, float weight)]
    for name, spec in specs.items():
        g = _gen(name)
        if spec.kind in ("fp8", "fp4"):
            w = _randn(spec.shape, spec.shape[1] ** -0.5, g)  # variance 1/fan_in
            to_quant.setdefault((spec.kind, spec.shape), []).append((name, w))
        elif spec.kind == "int":  # tid2eid [vocab, k]: k distinct experts per token
            order = torch.rand((spec.shape[0], cfg.n_routed_experts), generator=g).argsort(dim=1)
            out[name] = order[:, : spec.shape[1]].to(torch.int32)
        else:
            std, mean = float_init(name, spec.shape, cfg.dim)
            t = _randn(spec.shape, std, g, mean)
            out[name] = t.float() if fp32_in_release(name) else t.to(torch.bfloat16)
    # Quantise same-shaped weights in one batched call ([E, N, K]): 15 calls instead of ~180 for the
    # experts keeps generation near a second. Per-matrix results are the same as one call each.
    for (kind, _), items in to_quant.items():
        w = torch.stack([w for _, w in items])
        q, s = quant_fp8_block(w) if kind == "fp8" else quant_fp4(w)
        for i, (name, _) in enumerate(items):
            out[name], out[scale_name(name)] = q[i].clone(), s[i].clone()
    order = []  # expected_tensors order, each scale right after its weight
    for name, spec in specs.items():
        order += [name, scale_name(name)] if spec.kind in ("fp8", "fp4") else [name]
    return {n: out[n] for n in order}


def ensure_tiny_model(progress: bool = True) -> str:
    """Return the tiny model's directory, generating it first if needed (a second or so, ~140 MB).

    Safe against concurrent callers: each writes a private temporary directory and renames it into place;
    a loser of the race uses the winner's copy.
    """
    d = tiny_model_dir()
    if _complete(d):
        return d
    if os.path.exists(d):
        # write_checkpoint never leaves a partial directory, so this one was damaged from outside.
        raise CheckpointError(f"{d}: exists but is not a complete checkpoint (index, config.json or a shard missing); delete it to regenerate")
    _check_home(d)
    cfg = tiny_config()
    if progress:
        from rich.console import Console

        Console(stderr=True).print(f"[dim]generating {TINY_NAME} in {d} ...[/dim]")
    tensors = tiny_tensors(cfg)
    try:
        write_checkpoint(d, tensors, cfg.to_official_json(), max_shard_bytes=_MAX_SHARD_BYTES)
    except FileExistsError:
        if not _complete(d):
            raise
    return d
