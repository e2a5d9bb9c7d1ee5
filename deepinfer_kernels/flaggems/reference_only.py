"""Ops the FlagGems backend leaves to the torch reference on purpose, with the reason (plain data: `probe kernels`
reads it without importing FlagGems).

The FlagGems backend runs the V4 kernels FlagGems 5.0.2 ships where their contract is ours (act_quant, the
block-FP8 GEMM, rms_norm, mHC's Sinkhorn split and post-mix, sparse attention with a sink) and composes them into
the fused ops of our registry. FlagGems has no kernel with our contract for the ops below, so they resolve to the
reference without counting as a fallback, and `--strict` accepts them. (Its ATen-level ops -- add, mul, topk, ... --
are what `--flaggems op,...` swaps under any backend; they are not this list's business.)
"""

_NO_KERNEL = "FlagGems 5.0.2 ships no kernel for it"

REFERENCE_ONLY: dict[str, str] = {
    "fp8_fake_quant": f"{_NO_KERNEL} (the KV cache's FP8 QAT round trip)",
    "fp4_fake_quant": f"{_NO_KERNEL} (the FP4 QAT round trip)",
    "hadamard": f"{_NO_KERNEL} (DeepSeek's model.py calls the fast_hadamard_transform CUDA package)",
    "fp4_gemm": "FlagGems' only FP4 path dequantises mxfp4 inside fused_moe (dequant_mxfp4); it has no "
                "FP8 x FP4 dense GEMM",
    "grouped_gemm": "fused_moe is vLLM's whole MoE (align, both GEMMs, activation, weighted sum) over its own "
                    "sorted-token layout; our op is one GEMM per (token, expert) pair: adapting one to the other "
                    "is not a layout change, and is left for later",
    "fp8_grouped_linear": f"{_NO_KERNEL} (wo_a: a bmm over the groups of a dequantised FP8 weight)",
    "linear": "a plain bf16/fp32 F.linear (cuBLAS); FlagGems' mm is an ATen swap for --flaggems, and the field "
              "notes found it failing inside the engine",
    "rope": "FlagGems' apply_rotary_pos_emb is vLLM's (positions into a cos/sin cache, q and k together); ours "
            "rotates one tensor by given cos/sin, also inversely",
    "rms_norm_rope": f"{_NO_KERNEL} (the q/kv head norms, then RoPE)",
    "compress_pool": f"{_NO_KERNEL} (the compressor's softmax-gated pooling)",
    "compress_prefill": f"{_NO_KERNEL} (the compressor's prompt windows and carried state)",
    "compress_decode": f"{_NO_KERNEL} (the compressor's decode state update)",
    "indexer_scores": "FlagGems' DSA indexer (triton_lighting_indexer_k_tiled) is V3.2's ragged layout "
                      "(cu_seqlen ranges over one flat key list, fp32 logits); ours is [B, S, T] against a batched "
                      "or row-indexed key cache with model.py's bf16 roundings",
    "topk_indices": "a torch.topk; FlagGems' topk compiles for minutes at large k (the field notes: > 180 s at "
                    "k = 512) and its DSA bucket_sort_topk takes V3.2's ragged starts/ends",
    "decode_tables": f"{_NO_KERNEL} (table gathers and index arithmetic of a decode step)",
    "decode_slots": f"{_NO_KERNEL} (index arithmetic for the window and compressed entries)",
    "kv_store": f"{_NO_KERNEL} (cache writes by indexing)",
    "rms_norm_rope_store": f"{_NO_KERNEL} (the kv norm, RoPE, then the cache write by indexing)",
    "kv_pack": f"{_NO_KERNEL} (the FP8 KV cache's byte layout)",
    "kv_unpack": "the inverse byte re-layout of kv_pack (sparse_attn_fp8 here unpacks with it)",
    "hc_head": f"{_NO_KERNEL} (the final stream collapse: sigmoid mixes, no Sinkhorn)",
    "moe_route": "FlagGems' grouped_topk / topk_softmax are V3's sigmoid + group-limited and softmax routers; "
                 "V4's sqrt-softplus scores with hash-routed layers are not among them",
    "swiglu": "FlagGems' swiglu takes one concatenated tensor and applies no clamp; V4's is clamped (limit)",
    "moe_combine": f"{_NO_KERNEL} (a sum over the k routed rows plus the shared row)",
    "sample": "sampling is a handful of small reductions over the vocabulary; FlagGems' topk would compile per k",
    "logprobs": "a log-softmax of the logits (an ATen op --flaggems can swap: _log_softmax)",
    "apply_token_bitmask": "guided decoding's mask on the logits, part of sampling; FlagGems has no bitmask kernel",
    "spec_probs": "speculative decoding's sampling distribution, part of sampling; FlagGems has no such kernel",
    "spec_verify": "speculative decoding's acceptance and residual draw, part of sampling; FlagGems has no such kernel",
}
