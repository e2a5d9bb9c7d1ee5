"""Same-run A/B of the routed experts' grouped GEMM on a GPU: the TileLang kernel's forms (direct loads; staged:
TMA-fed, warp-specialised) against the Triton kernel, at V4-Flash shapes, each checked against the reference.

    PYTHONPATH=/tmp/site:$PWD python tools/tilelang_grouped_ab.py     # H200 site of ../shared/device/make-site.sh

Prints per shape: rows per block, each form's time (triton.testing.do_bench, median), TFLOP/s, the fraction of the
FP8 rate measured in the same run (8192^3 torch._scaled_mm) and the relative error against the reference.
"""
import torch
import triton

from deepinfer.ops.registry import REGISTRY, load_backend
from deepinfer.ops.reference import act_quant
from deepinfer.quant.formats import quant_fp4, scale_f32

load_backend("tilelang")
load_backend("triton")
from deepinfer_kernels.tilelang import moe  # noqa: E402

SHAPES = {  # name: (P rows = tokens x top-6, E, N, K)
    "decode B=1 w1|w3": (6, 256, 4096, 4096), "decode B=64 w1|w3": (384, 256, 4096, 4096),
    "prefill 2048 w1|w3": (12288, 256, 4096, 4096), "prefill 2048 w2": (12288, 256, 4096, 2048),
}


def fp8_rate() -> float:
    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    ms = triton.testing.do_bench(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16))
    return 2 * n ** 3 / ms / 1e9


def main() -> None:
    peak = fp8_rate()
    print(f"FP8 rate this run: {peak:.0f} TFLOP/s (8192^3 torch._scaled_mm)")
    g = torch.Generator("cuda").manual_seed(0)
    for name, (P, E, N, K) in SHAPES.items():
        w, s = quant_fp4(torch.randn(E * N, K, device="cuda", generator=g) * 0.05, 32)
        w, s = w.view(E, N, K // 2), scale_f32(s).view(E, N, K // 32)
        a, a_s = act_quant(torch.randn(P, K, device="cuda", generator=g), 128)
        e = torch.randint(0, E, (P,), device="cuda", generator=g)
        ref = REGISTRY["grouped_gemm"].ref(a, a_s, e, w, s).float()
        flops = 2 * P * N * K
        row = [f"{name:20s} BM {moe.block_m(P, E):3d}"]
        forms = {"tilelang direct": 10 ** 9, "tilelang staged": 0, "triton": None}
        for form, min_bm in forms.items():
            impl = REGISTRY["grouped_gemm"].impls["triton" if min_bm is None else "tilelang"]
            if min_bm is not None:
                moe.STAGED_MIN_BM = min_bm
            try:
                out = impl(a, a_s, e, w, s)
                rel = ((out.float() - ref).norm() / ref.norm()).item()
                ms = triton.testing.do_bench(lambda: impl(a, a_s, e, w, s))
                row.append(f"{form} {ms * 1e3:8.1f} us {flops / ms / 1e9:6.1f} TFLOP/s {100 * flops / ms / 1e9 / peak:4.1f} % "
                           f"rel {rel:.1e}")
            except Exception as ex:  # noqa: BLE001 - a form that fails is reported, the others still run
                row.append(f"{form} FAILED {type(ex).__name__}: {str(ex)[:120]}")
        print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
