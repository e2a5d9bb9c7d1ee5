"""transformers' `DeepseekV4ForCausalLM` built on a device with the same weights as the engine: the peer that
`deepinfer bench --peer transformers` times (`deepinfer.bench.peer`), `deepinfer dump --engine transformers` taps
(`deepinfer.debug.hf_dump`) and `deepinfer verify` holds our `exact` numerics against.

Official names are mapped to transformers' in-memory parameter names by `hf_name`. Outside the layers
those names are the ones `save_pretrained` writes, which the checkpoint reader already maps to official
(`deepinfer.checkpoint.reader._from_transformers`); that map is inverted here rather than kept twice.
Inside the layers transformers renames modules on load (its conversion_mapping.py) and writes the
official spelling back on save, so the checkpoint never holds these names and they are spelled out here.
"""

from __future__ import annotations

import math
import re

import torch

from deepinfer.checkpoint.reader import _from_transformers, routed_expert, scale_name
from deepinfer.checkpoint.schema import expected_tensors
from deepinfer.config import ModelConfig
from deepinfer.engine.loader import OptionError
from deepinfer.model.weights import Linear

_LAYER = re.compile(r"layers\.(\d+)\.(.*)")
# official -> transformers: leaves of a layer's attention, of its compressors (and the indexer's), of its
# shared expert
_ATTN = {"attn_sink": "sinks", "wq_a": "q_a_proj", "q_norm": "q_a_norm", "wq_b": "q_b_proj", "wkv": "kv_proj",
         "kv_norm": "kv_norm", "wo_a": "o_a_proj", "wo_b": "o_b_proj"}
_COMP = {"ape": "position_bias", "wkv": "kv_proj", "wgate": "gate_proj", "norm": "kv_norm"}
_SHARED = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
# transformers' names outside the layers, the same in memory and in a `save_pretrained` file
_HF_TOP = ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
           "model.hc_head.hc_fn", "model.hc_head.hc_base", "model.hc_head.hc_scale")
_TOP = {_from_transformers(t): t for t in _HF_TOP}


class PeerError(OptionError):
    """The transformers peer cannot be built or run; the message is the reason (one line, exit 2 at the CLI)."""


def require_transformers():
    """The transformers module with its DeepseekV4ForCausalLM, or PeerError saying how to get it (call before
    loading anything: a missing package is the user's environment, found before any work)."""
    try:
        import transformers
        from transformers import DeepseekV4ForCausalLM  # noqa: F401
    except ImportError as e:
        raise PeerError(f"transformers with DeepSeek-V4 is not importable here ({e}): "
                        "pip install 'transformers>=5.2'") from None
    return transformers


def hf_name(name: str) -> str | None:
    """Official name -> transformers `DeepseekV4ForCausalLM` parameter name (None: MTP, routed experts,
    which transformers stacks into `experts.gate_up_proj` / `experts.down_proj`, and `.scale`s).

    Top-level names: the inverse of the checkpoint reader's `_from_transformers`; layer names: the
    inverse of transformers' load-time renames for deepseek_v4 (conversion_mapping.py)."""
    if name in _TOP:
        return _TOP[name]
    m = _LAYER.fullmatch(name)
    if not m or name.endswith(".scale") or routed_expert(name) is not None:
        return None
    p, a = f"model.layers.{m[1]}.", m[2].split(".")
    if m[2] in ("attn_norm.weight", "ffn_norm.weight"):
        return p + ("input_layernorm" if a[0] == "attn_norm" else "post_attention_layernorm") + ".weight"
    if a[0].startswith("hc_"):  # hc_attn_fn -> attn_hc.fn
        _, which, what = a[0].split("_")
        return f"{p}{which}_hc.{what}"
    if a[0] == "attn":
        if a[1] == "compressor":
            return f"{p}self_attn.compressor.{_COMP[a[2]]}" + ("." + ".".join(a[3:]) if len(a) > 3 else "")
        if a[1] == "indexer":
            if a[2] == "compressor":
                return f"{p}self_attn.compressor.indexer.{_COMP[a[3]]}" + ("." + ".".join(a[4:]) if len(a) > 4 else "")
            sub = {"wq_b": "q_b_proj", "weights_proj": "scorer.weights_proj"}[a[2]]
            return f"{p}self_attn.compressor.indexer.{sub}." + ".".join(a[3:])
        return f"{p}self_attn.{_ATTN[a[1]]}" + ("." + ".".join(a[2:]) if len(a) > 2 else "")
    if a[0] == "ffn":
        if a[1] == "shared_experts":
            return f"{p}mlp.shared_experts.{_SHARED[a[2]]}.weight"
        if a[1] == "gate":
            return f"{p}mlp.gate." + {"bias": "e_score_correction_bias"}.get(a[2], a[2])
    raise PeerError(f"no transformers name for {name}")


def hf_config(cfg: ModelConfig):
    """A transformers DeepseekV4Config for the main layers of `cfg` (transformers has no MTP block)."""
    from transformers import DeepseekV4Config

    L = cfg.n_layers
    kinds, ratios = cfg.attn_kinds[:L], cfg.compress_ratios[:L]
    hca = {r for k, r in zip(kinds, ratios) if k == "hca"}
    csa = {r for k, r in zip(kinds, ratios) if k == "csa"}
    if len(hca) > 1 or csa - {4}:
        raise PeerError(f"transformers takes one ratio per attention kind; this config has CSA {csa}, HCA {hca}")
    names = {"swa": "sliding_attention", "csa": "compressed_sparse_attention", "hca": "heavily_compressed_attention"}
    rope = {"rope_type": "default"}
    if cfg.original_seq_len:
        rope = {"rope_type": "yarn", "factor": cfg.rope_factor, "beta_fast": cfg.beta_fast,
                "beta_slow": cfg.beta_slow, "original_max_position_embeddings": cfg.original_seq_len}
    return DeepseekV4Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, moe_intermediate_size=cfg.moe_inter_dim,
        num_hidden_layers=L, num_attention_heads=cfg.n_heads, head_dim=cfg.head_dim, q_lora_rank=cfg.q_lora_rank,
        qk_rope_head_dim=cfg.rope_head_dim, n_routed_experts=cfg.n_routed_experts,
        num_experts_per_tok=cfg.n_activated_experts,
        o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank, sliding_window=cfg.window_size,
        index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk,
        hc_mult=cfg.hc_mult, hc_sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps,
        layer_types=[names[k] for k in kinds], mlp_layer_types=["hash_moe" if h else "moe" for h in cfg.hash_layers],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": next(iter(hca), 128)},
        rope_theta=cfg.rope_theta, compress_rope_theta=cfg.compress_rope_theta, rope_parameters=rope,
        routed_scaling_factor=cfg.route_scale, swiglu_limit=cfg.swiglu_limit, scoring_func=cfg.score_func,
        rms_norm_eps=cfg.norm_eps, num_nextn_predict_layers=0, bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id,
    )


def _dequant(state: dict, name: str, dtype) -> torch.Tensor:
    """Official tensor `name` as a float tensor (exact: FP8/FP4 scales are powers of two)."""
    w = state[name]
    if w.dtype == torch.float8_e4m3fn:
        return Linear(w, state[scale_name(name)], "fp8").dequantized(dtype)
    if w.dtype in (torch.int8, torch.uint8) and scale_name(name) in state:
        return Linear(w.view(torch.int8), state[scale_name(name)], "fp4").dequantized(dtype)
    return w


def peer_bytes(cfg: ModelConfig) -> int:
    """bf16 bytes of the transformers model for `cfg` (main layers; fp32 parts counted as bf16)."""
    return sum(2 * math.prod(s.shape) for n, s in expected_tensors(cfg).items() if not n.startswith("mtp."))


@torch.no_grad()
def build_hf_peer(cfg: ModelConfig, state: dict, device: torch.device, dtype: torch.dtype = torch.bfloat16):
    """transformers' DeepseekV4ForCausalLM in `dtype` (eager attention) holding the same weights as `state`.

    Built on the device with `dtype` as the default dtype (the modules transformers keeps in fp32 create
    themselves in fp32, as under from_pretrained), then every parameter and persistent buffer is copied
    from the dequantised official tensors by name (`hf_name`); routed experts are stacked into
    `gate_up_proj` [E, 2I, D] (w1 then w3) and `down_proj` [E, D, I]. Any parameter left unfilled or any
    official tensor left unused is an error: a peer with random leftovers would time the wrong model."""
    from transformers import DeepseekV4ForCausalLM

    hcfg = hf_config(cfg)
    hcfg._attn_implementation = "eager"
    try:  # every parameter is overwritten below: skip transformers' random init (seconds at real sizes)
        from transformers.initialization import no_init_weights
    except ImportError:
        try:
            from transformers.modeling_utils import no_init_weights
        except ImportError:
            from contextlib import nullcontext as no_init_weights
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), no_init_weights():
            hf = DeepseekV4ForCausalLM(hcfg)
    finally:
        torch.set_default_dtype(prev)
    hf.eval()
    targets = dict(hf.named_parameters())
    targets.update((n, b) for n, b in hf.named_buffers() if n.endswith(("tid2eid", "e_score_correction_bias")))
    filled, I = set(), cfg.moe_inter_dim
    for name in state:
        if name.startswith("mtp.") or name.endswith(".scale"):
            continue
        e = routed_expert(name)
        if e is not None:
            m, w = _LAYER.fullmatch(name), name.rsplit(".", 2)[-2]
            base = f"model.layers.{m[1]}.mlp.experts."
            dst = targets[base + ("down_proj" if w == "w2" else "gate_up_proj")]
            view = dst[e] if w == "w2" else (dst[e, :I] if w == "w1" else dst[e, I:])
            view.copy_(_dequant(state, name, dst.dtype))
            filled.add(base + ("down_proj" if w == "w2" else "gate_up_proj"))
            continue
        hn = hf_name(name)
        if hn not in targets:
            raise PeerError(f"official {name} maps to {hn}, which DeepseekV4ForCausalLM does not have")
        t, src = targets[hn], _dequant(state, name, targets[hn].dtype)
        if tuple(t.shape) != tuple(src.shape):
            raise PeerError(f"{name} {list(src.shape)} does not fit transformers' {hn} {list(t.shape)}")
        t.copy_(src)
        filled.add(hn)
    left = sorted(set(targets) - filled)
    if left:
        raise PeerError(f"{len(left)} transformers parameters have no official source: {left[:4]}")
    return hf


