"""Model configuration: one dataclass for V4-Flash, V4-Pro and small configurations.

`config.json` is read in any of the three namings seen in the wild:

* the hub checkpoint's (`hidden_size`, `compress_ratios`, `num_hash_layers`, `rope_scaling`, ...),
* transformers' `DeepseekV4Config.save_pretrained` (`layer_types`, `mlp_layer_types`, `compress_rates`,
  `rope_parameters` keyed `main` / `compress`),
* the official inference code's `inference/config.json` (`dim`, `n_layers`, `compress_ratios`, ...).

Every value comes from the file: theta and YaRN numbers are never taken from code defaults (a port lost
days to 40 000 vs 160 000).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field

ATTN_KINDS = ("swa", "csa", "hca")
_HF_LAYER_TYPE = {
    "sliding_attention": "swa",
    "compressed_sparse_attention": "csa",
    "heavily_compressed_attention": "hca",
}


class ConfigError(ValueError):
    """A config.json that cannot describe a V4 model; the message names the file and the key."""


@dataclass(frozen=True)
class ModelConfig:
    """DeepSeek-V4 hyperparameters (official inference-code names where one exists).

    Per-layer schedules are tuples of length `n_layers + n_mtp_layers` for attention (the MTP block has
    its own attention kind) and `n_layers` for the MoE routing kind.
    """

    vocab_size: int = 129280
    dim: int = 4096
    n_layers: int = 43
    n_mtp_layers: int = 1
    n_heads: int = 64
    head_dim: int = 512
    rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    window_size: int = 128
    attn_kinds: tuple = ()  # per layer (+MTP): "swa" | "csa" | "hca"
    compress_ratios: tuple = ()  # per layer (+MTP): 0 for swa
    # RoPE: sliding-window layers use rope_theta without YaRN; compressed layers and the indexer use
    # compress_rope_theta with YaRN (when original_seq_len > 0), and no mscale.
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 16.0
    original_seq_len: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    moe_inter_dim: int = 2048
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    n_activated_experts: int = 6
    hash_layers: tuple = ()  # per layer: True where routing is the tid2eid table
    score_func: str = "sqrtsoftplus"
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    norm_eps: float = 1e-6
    bos_token_id: int = 0
    eos_token_id: int = 1
    # storage formats of the official layout
    weight_dtype: str = "fp8"  # "fp8" (e4m3 + ue8m0 128x128 scales) or "bf16"
    expert_dtype: str = "fp4"  # "fp4" (e2m1 + ue8m0 per-32 scales), "fp8" or "bf16"
    # the longest sequence (prompt + generation) the model serves; not architectural (no weight depends on
    # it), so it is outside the fingerprint. V4's config.json: max_position_embeddings 1048576.
    max_position_embeddings: int = field(default=1 << 20, compare=False)
    name: str = field(default="", compare=False)

    def __post_init__(self):
        for k, v in (("num_hidden_layers", self.n_layers), ("vocab_size", self.vocab_size)):
            if v < 1:  # before the schedules, whose lengths follow from it: the root cause named first
                raise ConfigError(f"{k} = {v}: must be at least 1")
        for k, v in (("bos_token_id", self.bos_token_id), ("eos_token_id", self.eos_token_id)):
            if not 0 <= v < self.vocab_size:  # an eos outside the vocabulary never stops a generation
                raise ConfigError(f"{k} = {v}: must be a token id, 0..{self.vocab_size - 1} (vocab_size)")
        n_attn = self.n_layers + self.n_mtp_layers
        if len(self.attn_kinds) != n_attn or len(self.compress_ratios) != n_attn:
            raise ConfigError(
                f"attention schedule has {len(self.attn_kinds)} entries, expected n_layers + n_mtp_layers = {n_attn}"
            )
        if len(self.hash_layers) != self.n_layers:
            raise ConfigError(f"MoE schedule has {len(self.hash_layers)} entries, expected n_layers = {self.n_layers}")
        for k in self.attn_kinds:
            if k not in ATTN_KINDS:
                raise ConfigError(f"unknown attention kind {k!r}; expected one of {ATTN_KINDS}")
        if self.head_dim <= self.rope_head_dim:
            raise ConfigError(f"head_dim {self.head_dim} must exceed rope_head_dim {self.rope_head_dim}")
        if (self.n_heads * self.head_dim) % self.o_groups:
            raise ConfigError(f"n_heads*head_dim {self.n_heads * self.head_dim} not divisible by o_groups {self.o_groups}")
        if self.n_shared_experts != 1:
            raise ConfigError(f"n_shared_experts={self.n_shared_experts}: V4 has exactly one shared expert")
        sizes = {"vocab_size": self.vocab_size, "hidden_size": self.dim, "num_hidden_layers": self.n_layers,
                 "num_attention_heads": self.n_heads, "head_dim": self.head_dim, "q_lora_rank": self.q_lora_rank,
                 "o_groups": self.o_groups, "o_lora_rank": self.o_lora_rank, "sliding_window": self.window_size,
                 "index_n_heads": self.index_n_heads, "index_head_dim": self.index_head_dim,
                 "index_topk": self.index_topk, "moe_intermediate_size": self.moe_inter_dim,
                 "n_routed_experts": self.n_routed_experts, "num_experts_per_tok": self.n_activated_experts,
                 "hc_mult": self.hc_mult, "max_position_embeddings": self.max_position_embeddings}
        for k, v in sizes.items():
            if v < 1:
                raise ConfigError(f"{k} = {v}: must be at least 1")
        if self.n_activated_experts > self.n_routed_experts:
            raise ConfigError(f"num_experts_per_tok = {self.n_activated_experts} exceeds n_routed_experts = "
                              f"{self.n_routed_experts}")
        if self.weight_dtype == "fp8":  # 128x128 weight blocks and per-128 activation blocks tile every GEMM
            for k in ("hidden_size", "q_lora_rank", "o_lora_rank", "moe_intermediate_size"):
                if sizes[k] % 128:
                    raise ConfigError(f"{k} = {sizes[k]}: must be a multiple of 128 (FP8 weights are stored in "
                                      "128x128 blocks with one scale each)")

    # -- derived -----------------------------------------------------------------------------
    @property
    def n_hash_layers(self) -> int:
        return sum(self.hash_layers)

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("name")
        d.pop("max_position_embeddings")
        return d

    def fingerprint(self) -> str:
        """Short hash of every architectural value: two runs of one model agree on it."""
        blob = json.dumps(self.to_dict(), sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def to_official_json(self) -> dict:
        """The hub checkpoint's config.json naming (what `deepinfer-tiny` writes)."""
        return {
            "architectures": ["DeepseekV4ForCausalLM"],
            "model_type": "deepseek_v4",
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "num_hidden_layers": self.n_layers,
            "num_nextn_predict_layers": self.n_mtp_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": 1,
            "head_dim": self.head_dim,
            "qk_rope_head_dim": self.rope_head_dim,
            "q_lora_rank": self.q_lora_rank,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "sliding_window": self.window_size,
            "compress_ratios": list(self.compress_ratios),
            "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta,
            "rope_scaling": {
                "type": "yarn",
                "factor": self.rope_factor,
                "original_max_position_embeddings": self.original_seq_len,
                "beta_fast": self.beta_fast,
                "beta_slow": self.beta_slow,
            },
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "moe_intermediate_size": self.moe_inter_dim,
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts,
            "num_experts_per_tok": self.n_activated_experts,
            "num_hash_layers": self.n_hash_layers,
            "scoring_func": self.score_func,
            "routed_scaling_factor": self.route_scale,
            "swiglu_limit": self.swiglu_limit,
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps,
            "rms_norm_eps": self.norm_eps,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "max_position_embeddings": self.max_position_embeddings,
            "expert_dtype": self.expert_dtype,
            "quantization_config": {
                "activation_scheme": "dynamic",
                "fmt": "e4m3",
                "quant_method": "fp8",
                "scale_fmt": "ue8m0",
                "weight_block_size": [128, 128],
            }
            if self.weight_dtype == "fp8"
            else None,
        }


def _kind_of_ratio(r: int) -> str:
    # The official code builds an overlapping compressor and an indexer exactly when the ratio is 4.
    return "swa" if r == 0 else ("csa" if r == 4 else "hca")


MODEL_TYPES = ("deepseek_v4",)


def _typed(v, typ, path: str, key: str):
    """v as int / float, or a ConfigError naming the key (a bool or a string is not a number here)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (typ is int and isinstance(v, float)
                                                                   and not v.is_integer()):
        raise ConfigError(f"{path}: {key} must be {'an integer' if typ is int else 'a number'}, got {v!r}")
    return typ(v)


def _int(d: dict, path: str, *keys) -> int:
    v = _req(d, path, *keys)
    return _typed(v, int, path, next(k for k in keys if k in d and d[k] is not None))


def _float(d: dict, path: str, *keys) -> float:
    v = _req(d, path, *keys)
    return _typed(v, float, path, next(k for k in keys if k in d and d[k] is not None))


def _opt(d: dict, path: str, typ, default, *keys):
    for k in keys:
        if k in d and d[k] is not None:
            return _typed(d[k], typ, path, k)
    return default


def _req(d: dict, path: str, *keys):
    for k in keys:
        if k in d and d[k] is not None:
            return d[k]
    raise ConfigError(f"{path}: missing key {' or '.join(repr(k) for k in keys)}")


def config_from_dict(d: dict, path: str = "config.json", n_mtp_layers: int | None = None) -> ModelConfig:
    """Build a ModelConfig from any supported naming. `path` only names the file in errors."""
    if not isinstance(d, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(d).__name__}")
    try:
        return _config_from_dict(d, path, n_mtp_layers)
    except ConfigError as e:  # __post_init__'s checks know the key, not the file
        if str(e).startswith(path):
            raise
        raise ConfigError(f"{path}: {e}") from None
    except (TypeError, ValueError, KeyError) as e:  # a wrongly typed value
        raise ConfigError(f"{path}: malformed value ({e})") from None


def _config_from_dict(d: dict, path: str, n_mtp_layers: int | None) -> ModelConfig:
    mt = d.get("model_type")
    if mt is not None and mt not in MODEL_TYPES:
        raise ConfigError(f"{path}: model_type {mt!r} is not DeepSeek-V4 (expected {' or '.join(MODEL_TYPES)})")
    n_layers = _int(d, path, "num_hidden_layers", "n_layers")
    n_mtp = _opt(d, path, int, 1, "num_nextn_predict_layers", "n_mtp_layers") if n_mtp_layers is None else n_mtp_layers

    # attention schedule
    if d.get("layer_types") is not None:
        rates = d.get("compress_rates") or {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
        lt = list(d["layer_types"])
        bad = [t for t in lt if t not in _HF_LAYER_TYPE]
        if bad:
            raise ConfigError(f"{path}: layer_types has unknown entries {bad}")
        kinds = [_HF_LAYER_TYPE[t] for t in lt][:n_layers]
        ratios = [0 if t == "sliding_attention" else int(rates[t]) for t in lt][:n_layers]
        # transformers has no MTP attention entry; the MTP block uses sliding-window attention
        # exactly like the official config's trailing 0.
        kinds += ["swa"] * n_mtp
        ratios += [0] * n_mtp
    else:
        cr = [int(r) for r in _req(d, path, "compress_ratios")]
        if len(cr) < n_layers:
            raise ConfigError(f"{path}: compress_ratios has {len(cr)} entries for {n_layers} layers")
        cr = cr[: n_layers + n_mtp] + [0] * max(0, n_layers + n_mtp - len(cr))
        kinds, ratios = [_kind_of_ratio(r) for r in cr], cr
    if len(kinds) != n_layers + n_mtp:
        raise ConfigError(f"{path}: layer_types has {len(kinds) - n_mtp} entries for {n_layers} layers")

    # MoE schedule
    if d.get("mlp_layer_types") is not None:
        mlt = list(d["mlp_layer_types"])[:n_layers]
        if len(mlt) != n_layers or any(t not in ("hash_moe", "moe") for t in mlt):
            raise ConfigError(f"{path}: mlp_layer_types must list 'hash_moe'/'moe' for each of {n_layers} layers")
        hash_layers = tuple(t == "hash_moe" for t in mlt)
    else:
        nh = _opt(d, path, int, 0, "num_hash_layers", "n_hash_layers")
        hash_layers = tuple(i < nh for i in range(n_layers))

    # RoPE
    rope_theta = _opt(d, path, float, 10000.0, "rope_theta")
    compress_theta = _float(d, path, "compress_rope_theta") if "rope_parameters" not in d or not isinstance(
        (d.get("rope_parameters") or {}).get("compress"), dict) else None
    yarn = None
    rp = d.get("rope_parameters")
    if isinstance(rp, dict) and isinstance(rp.get("compress"), dict):
        main, comp = rp.get("main") or {}, rp["compress"]
        rope_theta = float(main.get("rope_theta", rope_theta))
        compress_theta = _float(comp, f"{path} rope_parameters.compress", "rope_theta")
        if comp.get("rope_type", comp.get("type", "default")) == "yarn":
            yarn = comp
    elif isinstance(d.get("rope_scaling"), dict):
        yarn = d["rope_scaling"]
    elif isinstance(rp, dict) and rp.get("rope_type", rp.get("type")) == "yarn":
        yarn = rp
    elif "rope_factor" in d:  # official inference/config.json
        yarn = {"factor": d["rope_factor"], "original_max_position_embeddings": d.get("original_seq_len", 0),
                "beta_fast": d.get("beta_fast", 32), "beta_slow": d.get("beta_slow", 1)}
    if yarn is not None:
        rope_factor = _float(yarn, f"{path} yarn", "factor")
        original = _int(yarn, f"{path} yarn", "original_max_position_embeddings", "original_seq_len")
        beta_fast = _opt(yarn, f"{path} yarn", float, 32.0, "beta_fast")
        beta_slow = _opt(yarn, f"{path} yarn", float, 1.0, "beta_slow")
    else:
        rope_factor, original, beta_fast, beta_slow = 1.0, 0, 32.0, 1.0

    head_dim = _int(d, path, "head_dim")
    if "qk_rope_head_dim" in d or "rope_head_dim" in d:
        rope_head_dim = _int(d, path, "qk_rope_head_dim", "rope_head_dim")
    elif d.get("partial_rotary_factor") is not None:
        rope_head_dim = int(head_dim * float(d["partial_rotary_factor"]))
    else:
        rope_head_dim = 64

    qc = d.get("quantization_config") or {}
    if d.get("dtype") in ("fp8", "bf16"):  # official inference/config.json
        weight_dtype = d["dtype"]
    else:
        weight_dtype = "fp8" if qc.get("quant_method") == "fp8" or qc.get("fmt") == "e4m3" else "bf16"
    expert_dtype = d.get("expert_dtype") or qc.get("expert_dtype") or weight_dtype
    if expert_dtype not in ("fp4", "fp8", "bf16"):
        raise ConfigError(f"{path}: expert_dtype {expert_dtype!r} is not fp4, fp8 or bf16")
    eos = d.get("eos_token_id", 1)
    eos = eos[0] if isinstance(eos, list) else eos

    return ModelConfig(
        vocab_size=_int(d, path, "vocab_size"),
        dim=_int(d, path, "hidden_size", "dim"),
        n_layers=n_layers,
        n_mtp_layers=n_mtp,
        n_heads=_int(d, path, "num_attention_heads", "n_heads"),
        head_dim=head_dim,
        rope_head_dim=rope_head_dim,
        q_lora_rank=_int(d, path, "q_lora_rank"),
        o_groups=_int(d, path, "o_groups"),
        o_lora_rank=_int(d, path, "o_lora_rank"),
        window_size=_int(d, path, "sliding_window", "window_size"),
        attn_kinds=tuple(kinds),
        compress_ratios=tuple(ratios),
        rope_theta=rope_theta,
        compress_rope_theta=float(compress_theta),
        rope_factor=rope_factor,
        original_seq_len=original,
        beta_fast=beta_fast,
        beta_slow=beta_slow,
        index_n_heads=_int(d, path, "index_n_heads"),
        index_head_dim=_int(d, path, "index_head_dim"),
        index_topk=_int(d, path, "index_topk"),
        moe_inter_dim=_int(d, path, "moe_intermediate_size", "moe_inter_dim"),
        n_routed_experts=_int(d, path, "n_routed_experts"),
        n_shared_experts=_opt(d, path, int, 1, "n_shared_experts"),
        n_activated_experts=_int(d, path, "num_experts_per_tok", "n_activated_experts"),
        hash_layers=hash_layers,
        score_func=str(d.get("scoring_func", d.get("score_func", "sqrtsoftplus"))),
        route_scale=_opt(d, path, float, 1.0, "routed_scaling_factor", "route_scale"),
        swiglu_limit=_opt(d, path, float, 0.0, "swiglu_limit"),
        hc_mult=_opt(d, path, int, 4, "hc_mult"),
        hc_sinkhorn_iters=_opt(d, path, int, 20, "hc_sinkhorn_iters"),
        hc_eps=_opt(d, path, float, 1e-6, "hc_eps"),
        norm_eps=_opt(d, path, float, 1e-6, "rms_norm_eps", "norm_eps"),
        bos_token_id=int(d.get("bos_token_id", 0) if d.get("bos_token_id") is not None else 0),
        eos_token_id=int(eos if eos is not None else 1),
        weight_dtype=weight_dtype,
        expert_dtype=expert_dtype,
        max_position_embeddings=_opt(d, path, int, int(original * rope_factor) if original else 1 << 20,
                                     "max_position_embeddings"),
    )


def load_config(model_dir: str, n_mtp_layers: int | None = None) -> ModelConfig:
    """Read `model_dir/config.json`; every failure is one ConfigError naming the file."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: no config.json in the model directory")
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    cfg = config_from_dict(d, path, n_mtp_layers)
    return cfg.replace(name=os.path.basename(os.path.abspath(model_dir)))


def tiny_config() -> ModelConfig:
    """`deepinfer-tiny`: every V4 part at a size that runs in seconds on 2 CPU cores.

    Window 8, CSA ratio 4 with top-4 indexer selection, HCA ratio 16, so a 20-token prompt crosses the
    window, picks among compressed entries and completes an HCA entry. Dims are multiples of 128 so the
    FP8 128x128 blocks and per-128 activation quantisation apply unchanged; the real 129 280-id vocab.
    """
    ratios = (0, 4, 16, 4, 0)  # 4 layers + MTP
    return ModelConfig(
        vocab_size=129280, dim=256, n_layers=4, n_mtp_layers=1, n_heads=4, head_dim=128, rope_head_dim=64,
        q_lora_rank=128, o_groups=2, o_lora_rank=128, window_size=8,
        attn_kinds=tuple(_kind_of_ratio(r) for r in ratios), compress_ratios=ratios,
        rope_theta=10000.0, compress_rope_theta=160000.0, rope_factor=16.0, original_seq_len=65536,
        beta_fast=32.0, beta_slow=1.0, index_n_heads=8, index_head_dim=128, index_topk=4,
        moe_inter_dim=128, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2,
        hash_layers=(True, False, False, False), score_func="sqrtsoftplus", route_scale=1.5, swiglu_limit=10.0,
        hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-6, weight_dtype="fp8", expert_dtype="fp4",
        name="deepinfer-tiny",
    )
