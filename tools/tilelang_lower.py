"""Lower every TileLang kernel of the backend to CUDA source for sm_90a, without a GPU: a check that each builds
through TileLang's passes (layout inference, pipelining, TMA lowering) before a device run. Numerics are the GPU
tests' (tests/test_tilelang_kernels.py).

Needs TileLang importable (and nvcc, which compiles the extern decode of grouped_fp4.py), e.g. the H200 site of ../shared/device/make-site.sh (built for Python 3.12) with a
Python 3.12 that has torch:
    mkdir -p /tmp/site && tar -xJf .device/site.tar.xz -C /tmp/site
    PYTHONPATH=$PWD:/tmp/site python3.12 tools/tilelang_lower.py
"""
import sys

import tilelang
import tvm

from deepinfer_kernels.tilelang import attention, attention_ws, gemm, grouped_fp4, grouped_fp4_ws, indexer, moe, quant

TARGET = {"kind": "cuda", "arch": "sm_90a"}
CASES = [
    ("act_quant bf16 K=4096 block 128", lambda: quant.act_quant_kernel(4096, 128, "bfloat16")),
    ("act_quant fp32 K=256 block 64", lambda: quant.act_quant_kernel(256, 64, "float32")),
    ("rms_norm_quant bf16 K=4096 weighted", lambda: quant.rms_norm_quant_kernel(4096, "bfloat16", True, 1e-6)),
    ("rms_norm_quant bf16 K=7168", lambda: quant.rms_norm_quant_kernel(7168, "bfloat16", False, 1e-6)),
    ("fp8_gemm N=1536 K=4096 -> bf16", lambda: gemm.fp8_gemm_kernel(1536, 4096, "bfloat16")),
    ("fp8_gemm N=4096 K=8192 -> f32", lambda: gemm.fp8_gemm_kernel(4096, 8192, "float32")),
    ("sparse_attn flash H=64 D=512 K=640 bf16", lambda: attention.sparse_attn_kernel(64, 512, 640, "bfloat16", 512 ** -0.5)),
    ("sparse_attn ws flash H=64 D=512 K=640 bf16", lambda: (attention_ws.sparse_attn_ws_kernel(
        64, 512, 640, "bfloat16", 512 ** -0.5), attention_ws.PASS_CONFIGS)),
    ("sparse_attn ws pro-like H=128 D=512 K=1100 fp16", lambda: (attention_ws.sparse_attn_ws_kernel(
        128, 512, 1100, "float16", 512 ** -0.5), attention_ws.PASS_CONFIGS)),
    ("sparse_attn ws small H=64 D=128 K=12 bf16", lambda: (attention_ws.sparse_attn_ws_kernel(
        64, 128, 12, "bfloat16", 128 ** -0.5), attention_ws.PASS_CONFIGS)),
    ("sparse_attn tiny H=16 D=128 K=12 bf16", lambda: attention.sparse_attn_kernel(16, 128, 12, "bfloat16", 128 ** -0.5)),
    ("sparse_attn_fp8 flash H=64 D=512 K=640 bf16", lambda: attention.sparse_attn_kernel(
        64, 512, 640, "bfloat16", 512 ** -0.5, (448, 464, 592))),
    ("grouped_gemm fp4 flash w1 E=256 N=2048 K=4096", lambda: moe.grouped_fp4_kernel(256, 2048, 4096, "bfloat16")),
    ("grouped_gemm fp4 tiny E=8 N=64 K=256 -> f32", lambda: moe.grouped_fp4_kernel(8, 64, 256, "float32")),
    ("grouped_gemm fp4 bf16 form flash w1|w3 E=256 N=4096 K=4096 BM=64", lambda: grouped_fp4.grouped_fp4_bf16_kernel(
        256, 4096, 4096, "bfloat16", 64)),
    ("grouped_gemm fp4 bf16 form decode E=256 N=4096 K=2048 BM=16", lambda: grouped_fp4.grouped_fp4_bf16_kernel(
        256, 4096, 2048, "bfloat16", 16)),
    ("grouped_gemm fp4 bf16 form tiny E=8 N=192 K=256 BN=64 -> f32", lambda: grouped_fp4.grouped_fp4_bf16_kernel(
        8, 192, 256, "float32", 16, 64)),
    ("grouped_gemm fp4 fold form flash w1|w3 E=256 N=4096 K=4096 BM=128", lambda: grouped_fp4.grouped_fp4_fold_kernel(
        256, 4096, 4096, "bfloat16", 128)),
    ("grouped_gemm fp4 fold form flash w2 E=256 N=4096 K=2048 BM=64 -> f32", lambda: grouped_fp4.grouped_fp4_fold_kernel(
        256, 4096, 2048, "float32", 64, stages=2)),
    ("grouped_gemm fp4 fold form tiny E=8 N=192 K=256 BN=64", lambda: grouped_fp4.grouped_fp4_fold_kernel(
        8, 192, 256, "bfloat16", 64, 64, 2)),
    ("grouped_gemm fp4 fold ws flash w1|w3 E=256 N=4096 K=4096 BM=128", lambda: (
        grouped_fp4_ws.grouped_fp4_fold_ws_kernel(256, 4096, 4096, "bfloat16", 128), grouped_fp4_ws.PASS_CONFIGS)),
    ("grouped_gemm fp4 fold ws flash w2 E=256 N=4096 K=2048 BM=64 -> f32", lambda: (
        grouped_fp4_ws.grouped_fp4_fold_ws_kernel(256, 4096, 2048, "float32", 64), grouped_fp4_ws.PASS_CONFIGS)),
    ("grouped_gemm fp4 fold ws tiny E=8 N=256 K=256 BM=64", lambda: (
        grouped_fp4_ws.grouped_fp4_fold_ws_kernel(8, 256, 256, "bfloat16", 64), grouped_fp4_ws.PASS_CONFIGS)),
    ("grouped_gemm fp4 gather + split K=4096", lambda: grouped_fp4.gather_split_kernel(4096, 64)),
    ("grouped_gemm fp8 E=16 N=512 K=1024", lambda: moe.grouped_fp8_kernel(16, 512, 1024, "bfloat16")),
    ("indexer_scores flash H=64 D=128", lambda: indexer.indexer_scores_kernel(64, 128)),
    ("indexer_scores tiny H=4 D=64", lambda: indexer.indexer_scores_kernel(4, 64)),
    ("fp4_fake_quant bf16 K=128 block 32", lambda: quant.fp4_fake_quant_kernel(128, 32, "bfloat16")),
]


def main() -> int:
    bad = 0
    only = sys.argv[1] if len(sys.argv) > 1 else ""
    for name, make in CASES:
        if only not in name:
            continue
        try:
            made = make()  # a prim_func, or (prim_func, the pass configs it compiles with)
            func, config = made if isinstance(made, tuple) else (made, {})
            with tvm.transform.PassContext(opt_level=3, config=config), tvm.target.Target(TARGET):
                art = tilelang.lower(func, target=TARGET)
            print(f"ok    {name}: {len(art.kernel_source)} chars of CUDA")
        except Exception as e:
            bad += 1
            print(f"FAIL  {name}: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[-1][:300]}")
    n = sum(only in name for name, _ in CASES)
    print(f"{n - bad} of {n} lowered (tilelang {tilelang.__version__}, {TARGET['arch']})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
