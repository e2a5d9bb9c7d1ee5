"""Ops the TileLang backend leaves to the torch reference on purpose, with the reason (plain data: `probe kernels`
reads it without importing TileLang).

The TileLang backend stands for DeepSeek's own V4 stack: the kernels of its inference `kernel.py` (act_quant,
fp4_act_quant, fp8_gemm, fp4_gemm, sparse_attn, hc_split_sinkhorn) and of its TileKernels package (mHC, MoE
gating), plus the indexer scores. What DeepSeek's `inference/model.py` computes in PyTorch is PyTorch here too,
so that a TileLang run is the official stack op for op; these ops resolve to the reference without counting as a
fallback, and `--strict` accepts them.
"""

_MODEL_PY = "DeepSeek's inference/model.py computes it in PyTorch"

REFERENCE_ONLY: dict[str, str] = {
    "rms_norm": f"{_MODEL_PY} (RMSNorm); the fused norm + FP8 quant is a kernel here (rms_norm_quant)",
    "hadamard": ("model.py calls the fast_hadamard_transform CUDA package, not a TileLang kernel; the indexer's "
                 "FP4 rounding, part of this op (fp4_block), then runs in the reference too (the same values as "
                 "this backend's fp4_fake_quant kernel)"),
    "linear": f"{_MODEL_PY} (F.linear of the bf16 weights: the head, the compressors, the gate)",
    "fp8_grouped_linear": f"{_MODEL_PY} (wo_a: convert.py dequantises it, then a bmm over the groups)",
    "rope": f"{_MODEL_PY} (apply_rotary_emb)",
    "rms_norm_rope": f"{_MODEL_PY} (the q/kv norms, then apply_rotary_emb)",
    "compress_pool": f"{_MODEL_PY} (Compressor: softmax-gated pooling)",
    "compress_prefill": f"{_MODEL_PY} (Compressor.forward over a prompt: window assembly, pooling, carried state)",
    "compress_decode": f"{_MODEL_PY} (Compressor's decode state update)",
    "topk_indices": f"{_MODEL_PY} (the indexer's torch.topk)",
    "decode_tables": f"{_MODEL_PY} (each layer gathers its own freqs_cis rows: no kernel of its own)",
    "decode_slots": f"{_MODEL_PY} (get_window_topk_idxs and the compressed-entry indices)",
    "kv_store": f"{_MODEL_PY} (cache writes by indexing)",
    "rms_norm_rope_store": f"{_MODEL_PY} (the kv norm, apply_rotary_emb, then the cache write by indexing)",
    "kv_pack": "the FP8 KV cache layout is a byte re-layout around act_quant (which is a kernel here); the release "
               "keeps its cache in bf16",
    "kv_unpack": "the inverse byte re-layout of kv_pack",
    "hc_head": f"{_MODEL_PY} (hc_head: the final stream collapse, no Sinkhorn)",
    "swiglu": f"{_MODEL_PY} (Expert: silu(w1 x) * w3 x, clamped)",
    "moe_combine": f"{_MODEL_PY} (MoE: the sum of the routed and shared experts)",
    "sample": "sampling is a handful of small reductions over the vocabulary, latency-bound; DeepSeek's "
              "generate.py samples in PyTorch",
    "logprobs": "a log-softmax of the logits, as sample",
    "apply_token_bitmask": "guided decoding's mask on the logits, part of sampling (as sample); DeepSeek's release "
                           "has no guided decoding",
    "spec_probs": "speculative decoding's sampling distribution, as sample",
    "spec_verify": "speculative decoding's acceptance and residual draw: two passes over K + 1 rows, as sample",
}
