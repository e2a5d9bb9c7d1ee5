"""The prefill FP8 GEMM's exact forms against each other and the per-128-K ones, at flash shapes, in one process:
does `DEEPINFER_FP8_GEMM=exact-wgmma` (exact products on f16 wgmma) beat the default `exact` (the FP8 dot with no
imprecise accumulation, which Triton lowers to f16 mma.sync) with the same sums, and which tiles should it take?

Per shape (M 4096 rows, the flash slice's dense FP8 GEMMs), per variant: ms (`triton.testing.do_bench`, L2 flushed
between calls, the median), TFLOP/s, the output's relative error against the fp32 reference of the same exact
products (`fp8_gemm`'s torch reference), the share of bf16 outputs that differ from that reference rounded to
bf16, and the share that differ from `exact`'s (0 = the same bits). `triton` (promotion per 128-K block) and
`cublas` (cuBLASLt's block-scaled GEMM) are the fast-policy rates beside them, not candidates for `official`. The
operands are `ab`'s for fp8_gemm: act_quant'ed activations, block-quantised weights with power-of-two scales.

    PYTHONPATH=$PWD python tools/device/fp8_exact_sweep.py [--out fp8_exact_sweep.json]
    TRITON_INTERPRET=1 python tools/device/fp8_exact_sweep.py --smoke   # CPU: one small shape, no timing
"""

from __future__ import annotations

import os
import sys

import torch

from deepinfer.ops import REGISTRY

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sweep_report  # noqa: E402

SHAPES = [("wq_a|wkv", 1536, 4096), ("wq_b", 32768, 1024), ("wo_b", 4096, 8192), ("shared w1|w3", 4096, 4096),
          ("shared w2", 4096, 2048), ("indexer wq_b", 8192, 1024)]  # name, N, K
M = 4096
VARIANTS = {  # name -> (DEEPINFER_FP8_GEMM, TMA_TILES_F16 or None)
    "exact": ("exact", None),
    "exact-wgmma 64x128 w4 s3": ("exact-wgmma", (64, 128, 16, 4, 3)),
    "exact-wgmma 64x128 w4 s4": ("exact-wgmma", (64, 128, 16, 4, 4)),
    "exact-wgmma 64x128 w4 s2": ("exact-wgmma", (64, 128, 16, 4, 2)),
    "exact-wgmma 128x128 w8 s3": ("exact-wgmma", (128, 128, 16, 8, 3)),
    "exact-wgmma 128x64 w4 s3": ("exact-wgmma", (128, 64, 16, 4, 3)),
    "exact-wgmma 64x64 w4 s3": ("exact-wgmma", (64, 64, 16, 4, 3)),
    "triton (per 128-K)": ("triton", None),
    "cublas (per 128-K)": ("cublas", None),
}


def main(argv: list[str]) -> int:
    args = sweep_report.parse(argv, "fp8_exact_sweep", "one small shape, no timing (the interpreter on a CPU)")
    import triton

    from deepinfer.debug.ab_cases import _fp8_operands
    from deepinfer_kernels.triton import gemm, gemm_vendor

    dev = "cpu" if args.smoke else "cuda"
    shapes, m = ([("small", 256, 512)], 130) if args.smoke else (SHAPES, M)
    rows, tiles0, env0 = [], gemm.TMA_TILES_F16, os.environ.get("DEEPINFER_FP8_GEMM")
    for name, N, K in shapes:
        ops = _fp8_operands(torch.Generator().manual_seed(N + K), m, N, K, dev)  # `ab`'s fp8_gemm operands
        ref = REGISTRY["fp8_gemm"].ref(*ops, torch.float32)
        exact_out = None
        for vname, (mode, tiles) in VARIANTS.items():
            os.environ["DEEPINFER_FP8_GEMM"] = mode
            gemm.TMA_TILES_F16 = tiles or tiles0
            row = {"shape": name, "M": m, "N": N, "K": K, "variant": vname, "mode": mode, "tiles": tiles}
            try:
                if mode == "cublas" and gemm_vendor.unavailable(torch.device(dev)) is not None:
                    raise RuntimeError(gemm_vendor.unavailable(torch.device(dev)))
                out = gemm.fp8_gemm(*ops, torch.bfloat16)
                ms = None if args.smoke else triton.testing.do_bench(lambda: gemm.fp8_gemm(*ops, torch.bfloat16),
                                                                       return_mode="median")
            except Exception as e:  # noqa: BLE001 - a variant that does not run is a row, the others go on
                row["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"
                rows.append(row)
                print(f"{name:13s} {vname:27s} {row['error']}", flush=True)
                continue
            finally:
                gemm.TMA_TILES_F16 = tiles0
                if env0 is None:
                    os.environ.pop("DEEPINFER_FP8_GEMM", None)
                else:
                    os.environ["DEEPINFER_FP8_GEMM"] = env0
            exact_out = out if mode == "exact" else exact_out
            rel = ((out.float() - ref).norm() / ref.norm()).item()
            differ = (out != exact_out).float().mean().item() if exact_out is not None else None
            off_ref = (out != ref.to(torch.bfloat16)).float().mean().item()
            row.update(ms=ms, tflops=2 * m * N * K / ms / 1e9 if ms else None, rel_err=rel,
                       differ_from_exact=differ, differ_from_ref=off_ref, nan=bool(torch.isnan(out).any()))
            rows.append(row)
            print(f"{name:13s} {vname:27s} " + (f"{ms:7.3f} ms {row['tflops']:6.0f} TFLOP/s" if ms else "(smoke)")
                  + f"  rel err {rel:.1e}, bf16 outputs off the reference's {off_ref:.2%}, off exact's "
                  + ("-" if differ is None else f"{differ:.2%}"),
                  flush=True)
    names = sweep_report.write(args.out, dev, rows)
    bad = [r for r in rows if r.get("nan") or (r.get("rel_err") or 0) > 1e-2]
    print(f"{names}: {len(rows)} rows, {sum('error' in r for r in rows)} did not run, {len(bad)} wrong (NaN or > 1e-2 "
          "from the reference)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
