"""Small random DeepseekV4ForCausalLM checkpoints written by transformers' save_pretrained."""

from __future__ import annotations

import torch

_TYPE = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}


def build_hf_model(out_dir: str, seed: int = 0, hc_mult: int = 4, layer_ratios=(0, 4, 8, 4), n_hash: int = 1,
                   window: int = 8, index_heads: int = 16, index_topk: int = 3, vocab: int = 512):
    """A float32 transformers V4 with every part exercised, saved to `out_dir`; returns the model.

    Random parameters are drawn with spreads that keep activations O(1) (transformers' own init makes
    sinks, biases and position biases zero, which would hide mistakes there). Indexer heads default to
    16: with few heads the ReLU scores tie at exactly 0, and then `topk` order is arbitrary.
    """
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    hca = max(r for r in layer_ratios)
    cfg = DeepseekV4Config(
        vocab_size=vocab, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=len(layer_ratios),
        num_attention_heads=4, head_dim=32, q_lora_rank=32, qk_rope_head_dim=8, n_routed_experts=8,
        num_experts_per_tok=2, o_groups=2, o_lora_rank=16, sliding_window=window, index_n_heads=index_heads,
        index_head_dim=16, index_topk=index_topk, hc_mult=hc_mult, layer_types=[_TYPE[0 if r == 0 else 4 if r == 4 else 128] for r in layer_ratios],
        mlp_layer_types=["hash_moe"] * n_hash + ["moe"] * (len(layer_ratios) - n_hash), compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": hca},
        rope_parameters={"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
    )
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    m = DeepseekV4ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if any(k in n for k in ("sinks", "position_bias", "bias", "base")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif "scale" in n:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif "norm" in n:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
        for mod in m.modules():
            if hasattr(mod, "tid2eid"):
                mod.tid2eid.copy_(torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(vocab)]))
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.copy_(torch.randn(8, generator=g) * 0.1)
    m.save_pretrained(out_dir)
    return m
