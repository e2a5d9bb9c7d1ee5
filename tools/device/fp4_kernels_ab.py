"""The TileLang grouped FP4 GEMM's folded forms side by side on a GPU, kernels alone (`triton.testing.do_bench`, one
process): grouped_fp4_ws.py's pipeline at each L2 prefetch size against grouped_fp4.py's first fold kernel, output
bits compared, at the flash prefill shapes (random FP4 codes, scale bytes 115-121, E 256, uniform routing). Ran on
the H200 on 2026-12-03 (perf-log, *The folded FP4 GEMM's hand-written pipeline*). Needs TileLang and the backend
importable as `deepinfer_kernels` (see tools/tilelang_lower.py):
    PYTHONPATH=/tmp/site:$PWD python tools/device/fp4_kernels_ab.py
"""
import tilelang
import torch
from triton.testing import do_bench

from deepinfer.ops.reference import act_quant
from deepinfer_kernels.tilelang import grouped_fp4
from deepinfer_kernels.tilelang import grouped_fp4_ws as ws
from deepinfer_kernels.tilelang._common import expert_blocks

SHAPES = [(24576, 4096, 4096), (24576, 4096, 2048), (12288, 2048, 4096)]  # rows x N x K: w1|w3, w2; w1 at 2048


def main():
    dev, E, out = "cuda", 256, []
    for P, N, K in SHAPES:
        g = torch.Generator(dev).manual_seed(P + N + K)
        w = torch.randint(0, 256, (E, N, K // 2), device=dev, generator=g, dtype=torch.uint8)
        w_s = torch.randint(115, 122, (E, N, K // 32), device=dev, generator=g).to(torch.uint8)
        a, a_s = act_quant(torch.randn(P, K, device=dev, generator=g), 128)
        e = torch.randint(0, E, (P,), device=dev, generator=g)
        BM = grouped_fp4.block_rows(P, E)
        first = grouped_fp4.compile_grouped(E, N, K, "bfloat16", BM, 4 if BM == 128 else 3, fold=True)
        c, rows, bexp = expert_blocks(e, P, N, E, BM, torch.bfloat16)
        src = rows.clamp(max=P - 1)
        ws32 = w_s.contiguous().view(E * N, K // 32).view(torch.int32).view(E * N, K // 128)
        wq = w.view(E * N, K // 2)
        a2 = a.view(torch.uint8).index_select(0, src).view(torch.float8_e4m3fn)
        ast = a_s.float().t().index_select(1, src).contiguous()
        asf, r2 = a_s.float().contiguous(), rows.view(-1, BM)
        first(a2, ast, wq, ws32, r2, bexp, c)
        flops = 2 * P * N * K
        t = {"first fold": do_bench(lambda: first(a2, ast, wq, ws32, r2, bexp, c), warmup=20, rep=200)}
        same = {}
        for pf in (0, 128, 256):
            k = tilelang.compile(ws.grouped_fp4_fold_ws_kernel(E, N, K, "bfloat16", BM, pf), out_idx=[],
                                 pass_configs=ws.PASS_CONFIGS)
            c2 = torch.zeros_like(c)
            k(a, asf, wq, ws32, r2, bexp, c2)
            same[pf] = torch.equal(c, c2)
            t[f"ws L2::{pf}B"] = do_bench(lambda: k(a, asf, wq, ws32, r2, bexp, c2), warmup=20, rep=200)
        out.append(f"{P} x {N} x {K} (BM {BM}) bits equal {same} | "
                   + "  ".join(f"{n} {v:.3f} ms ({flops / v / 1e9:.0f} TFLOP/s)" for n, v in t.items()))
        print(out[-1], flush=True)
    print("\n".join(out))


if __name__ == "__main__":
    main()
