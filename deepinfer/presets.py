"""Model shapes without a checkpoint: V4-Flash, V4-Pro, N-layer slices of either, and deepinfer-tiny.

Used by `deepinfer bench --preset ...` with random weights (`deepinfer.engine.random_weights`).

Provenance of the values (verified = matches the release `config.json` as quoted in public code and
notes, and transformers' `DeepseekV4Config` defaults, which are the Flash release values):

* Flash, verified: vocab 129280, hidden 4096, 43 layers + 1 MTP, 64 heads x 512 (rope 64), q_lora 1024,
  o_groups 8 x o_lora 1024, window 128, compress_ratios [0, 0, 4, 128, 4, 128, ..., 4, 0] (44 entries,
  the last is the MTP block), rope_theta 10000, compress_rope_theta 160000, YaRN factor 16 / original
  65536 / beta 32, 1, indexer 64 heads x 128 top-512, 256 experts x 2048 top-6, 1 shared, 3 hash layers,
  sqrtsoftplus, route scale 1.5, swiglu limit 10, hc 4, sinkhorn 20, FP8 dense + FP4 experts.
* Pro, verified: hidden 7168, 61 layers, 128 heads x 512, q_lora 1536, o_groups 16 x 1024, window 128,
  compress_ratios [128, 128, 4, 128, ..., 4, 0] (62 entries; no SWA-only main layer), indexer
  64 x 128 top-1024, 384 experts x 3072 top-6, 3 hash layers, route scale 2.5, same RoPE/YaRN numbers.
* Pro, ASSUMED (same as Flash, not seen in a quoted Pro config): 1 MTP layer, hc 4 / sinkhorn 20 /
  eps 1e-6, swiglu limit 10 (quoted in one source), expert_dtype fp4, norm eps 1e-6.
"""

from __future__ import annotations

import re

from deepinfer.config import ConfigError, ModelConfig, _kind_of_ratio, tiny_config


def _schedule(ratios: list[int]) -> dict:
    return {"compress_ratios": tuple(ratios), "attn_kinds": tuple(_kind_of_ratio(r) for r in ratios)}


def flash_config() -> ModelConfig:
    """DeepSeek-V4-Flash (43 layers + MTP, 256 experts): the release shapes."""
    ratios = [0, 0] + [4, 128] * 20 + [4] + [0]  # 43 main layers, then the MTP block (SWA)
    return ModelConfig(
        vocab_size=129280, dim=4096, n_layers=43, n_mtp_layers=1, n_heads=64, head_dim=512, rope_head_dim=64,
        q_lora_rank=1024, o_groups=8, o_lora_rank=1024, window_size=128, **_schedule(ratios),
        rope_theta=10000.0, compress_rope_theta=160000.0, rope_factor=16.0, original_seq_len=65536,
        beta_fast=32.0, beta_slow=1.0, index_n_heads=64, index_head_dim=128, index_topk=512,
        moe_inter_dim=2048, n_routed_experts=256, n_shared_experts=1, n_activated_experts=6,
        hash_layers=tuple(i < 3 for i in range(43)), score_func="sqrtsoftplus", route_scale=1.5,
        swiglu_limit=10.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-6,
        weight_dtype="fp8", expert_dtype="fp4", name="v4-flash",
    )


def pro_config() -> ModelConfig:
    """DeepSeek-V4-Pro (61 layers + MTP, 384 experts); see the module docstring for assumed values."""
    ratios = [128, 128] + [4, 128] * 29 + [4] + [0]  # 61 main layers, then the MTP block
    return flash_config().replace(
        dim=7168, n_layers=61, n_heads=128, q_lora_rank=1536, o_groups=16, o_lora_rank=1024,
        **_schedule(ratios), index_topk=1024, moe_inter_dim=3072, n_routed_experts=384,
        hash_layers=tuple(i < 3 for i in range(61)), route_scale=2.5, name="v4-pro",
    )


def slice_config(cfg: ModelConfig, n: int) -> ModelConfig:
    """The first layers of `cfg` cut to `n`, keeping every attention kind the source's layers have.

    Picks the first layer of each kind present among the source's main layers, fills up with the
    lowest-numbered remaining layers and keeps source order (Flash n=4: swa, swa, csa, hca; n=3: swa,
    csa, hca). Pro has no SWA main layer, so its slices have SWA only in the MTP block, as the real
    model does. Hash layers: the first min(source's, 3, n-1), so at least one top-k layer remains.
    The MTP entries are kept.
    """
    L = cfg.n_layers
    if not 1 <= n <= L:
        raise ConfigError(f"slice of {n} layers: must be 1..{L} for {cfg.name or 'this config'}")
    picked: list[int] = []
    for kind in ("swa", "hca", "csa"):
        first = next((i for i in range(L) if cfg.attn_kinds[i] == kind), None)
        if first is not None and len(picked) < n:
            picked.append(first)
    for i in range(L):
        if len(picked) >= n:
            break
        if i not in picked:
            picked.append(i)
    idx = sorted(picked) + list(range(L, L + cfg.n_mtp_layers))
    n_hash = min(cfg.n_hash_layers, 3, max(n - 1, 0))
    return cfg.replace(
        n_layers=n, attn_kinds=tuple(cfg.attn_kinds[i] for i in idx),
        compress_ratios=tuple(cfg.compress_ratios[i] for i in idx),
        hash_layers=tuple(i < n_hash for i in range(n)), name=f"{cfg.name or 'model'}-slice{n}",
    )


_SPEC = re.compile(r"(flash|pro)(?:-slice:(\d+))?")


class PresetError(ValueError):
    """A `--preset` value that names no model (the message names the option; no config.json is involved)."""


def preset_config(spec: str) -> ModelConfig:
    """`tiny` | `flash` | `pro` | `flash-slice:N` | `pro-slice:N` -> ModelConfig."""
    s = (spec or "").strip().lower()
    if s in ("tiny", "deepinfer-tiny"):
        return tiny_config()
    m = _SPEC.fullmatch(s)
    if not m:
        raise PresetError(f"--preset {spec!r}: expected tiny, flash, pro, flash-slice:N or pro-slice:N")
    cfg = flash_config() if m[1] == "flash" else pro_config()
    if m[2] and not 1 <= int(m[2]) <= cfg.n_layers:
        raise PresetError(f"--preset {spec!r}: N must be 1..{cfg.n_layers}, the layers of {cfg.name}")
    return slice_config(cfg, int(m[2])) if m[2] else cfg
