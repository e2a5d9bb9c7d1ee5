"""Ops the DeepGEMM backend leaves to the torch reference, with the reason (plain data: `probe kernels` reads it
without importing the backend). DeepGEMM is a GEMM library: its FP8 dense and m-grouped GEMMs are wired (`gemm.py`);
every other op of the model is decided here, so a new op fails `tests/test_reference_only.py` until it is."""

_NO_KERNEL = "DeepGEMM ships GEMMs and attention scorers, not this op"
_ATTN = "sparse attention is FlashMLA's and TileLang's in DeepSeek's stack, not DeepGEMM's"

REFERENCE_ONLY: dict[str, str] = {
    "rms_norm": _NO_KERNEL,
    "act_quant": _NO_KERNEL,
    "rms_norm_quant": _NO_KERNEL,
    "fp8_fake_quant": _NO_KERNEL,
    "fp4_fake_quant": _NO_KERNEL,
    "hadamard": _NO_KERNEL,
    "fp8_grouped_linear": "DeepGEMM's k-grouped GEMMs take another layout than wo_a's per-group [T, G, K] x [G, R, K] "
                          "product with 128 x 128 FP8 blocks",
    "linear": "bf16 / fp32 projections: this adapter wires DeepGEMM's SM90 FP8 GEMMs only",
    "rope": _NO_KERNEL,
    "rms_norm_rope": _NO_KERNEL,
    "compress_pool": _NO_KERNEL,
    "compress_prefill": _NO_KERNEL,
    "compress_decode": _NO_KERNEL,
    "indexer_scores": "DeepGEMM's fp8_mqa_logits takes FP8 q and per-row scaled FP8 keys; V4's indexer scores its "
                      "FP4-QAT q and keys in bf16 (model.py): another contract",
    "topk_indices": _NO_KERNEL,
    "decode_tables": _NO_KERNEL,
    "decode_slots": _NO_KERNEL,
    "sparse_attn": _ATTN,
    "kv_pack": _NO_KERNEL,
    "kv_unpack": _NO_KERNEL,
    "sparse_attn_fp8": _ATTN,
    "q_norm_sparse_attn_fp8": _ATTN,
    "hc_pre": _NO_KERNEL,
    "hc_pre_quant": _NO_KERNEL,
    "hc_post": _NO_KERNEL,
    "hc_post_pre_quant": _NO_KERNEL,
    "hc_head": _NO_KERNEL,
    "moe_route": _NO_KERNEL,
    "swiglu": _NO_KERNEL,
    "swiglu_quant": _NO_KERNEL,
    "moe_combine": _NO_KERNEL,
    "moe_combine_post": _NO_KERNEL,
    "moe_combine_post_pre_quant": _NO_KERNEL,
    "moe_combine_post_head": _NO_KERNEL,
    "kv_store": _NO_KERNEL,
    "rms_norm_rope_store": _NO_KERNEL,
    "sample": _NO_KERNEL,
    "spec_probs": _NO_KERNEL,
    "spec_verify": _NO_KERNEL,
    "logprobs": _NO_KERNEL,
    "apply_token_bitmask": _NO_KERNEL,
}
