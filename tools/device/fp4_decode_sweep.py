"""The Triton FP4 expert GEMM at decode sizes under launch configs other than `_fp4_config`'s and with its 128-K steps
in sub-steps (`DECODE_KSUB`: fewer registers, more instructions a step), graph-timed in one process: is the shipped
form (128 weight rows x 16 tokens, 4 warps, whole steps) still the fastest?

Flash shapes (E 256, top-6, random FP4 codes with scale bytes 115-121, so the folded decode runs as in a model):
w1|w3 (N 4096, K 4096) and w2 (N 4096, K 2048) at batch 1 (one token's row for its 6 pairs: IDENT blocks) and
batch 64 (384 pairs, 16-row sorted blocks). Each timing is a CUDA graph of REPLAYS calls, each with its own
routing (so the experts' weights come from HBM, not L2), replayed; us per call, the median of 5 replays. Each
variant's output is compared with the shipped one's (split-K changes the fp32 sum order only: a relative
difference near 1e-6 is expected, a wrong tile is O(1)).

    PYTHONPATH=$PWD python tools/device/fp4_decode_sweep.py [--out sweep.json]
    TRITON_INTERPRET=1 python tools/device/fp4_decode_sweep.py --smoke   # CPU: tiny shapes, one call, no timing
"""

from __future__ import annotations

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sweep_report  # noqa: E402

from deepinfer.ops import REGISTRY
from deepinfer.ops.reference import act_quant

VARIANTS = {  # name -> launch config (BN, num_warps, num_stages) for blocks of <= 32 rows (None: `_fp4_config`'s)
    "shipped": (None, 1),                 # and the sub-steps per 128-K step (`moe_grouped.DECODE_KSUB`)
    "8 warps": ((128, 8, 3), 1),
    "64 rows": ((64, 4, 3), 1),
    "64 rows, 2 warps": ((64, 2, 3), 1),
    "2 sub-steps": (None, 2),
    "4 sub-steps": (None, 4),
}
SHAPES = [("w1|w3", 4096, 4096), ("w2", 4096, 2048)]  # name, N, K
BATCHES = (1, 64)
TOPK, E, REPLAYS = 6, 256, 20


def _patched(mg, variant):
    """moe_grouped._fp4_config returning `variant` (BN, warps, stages) for decode-sized blocks."""
    real = mg._fp4_config

    def cfg(nb, N, K, BM, n_fast, device):
        if variant is None or BM > 32:
            return real(nb, N, K, BM, n_fast, device)
        BN, nw, ns = variant
        per, splits = mg.split_k(-(-K // 128), nb * -(-N // BN), 2 * mg._sms(device))
        return BN, splits, per, nw, ns
    return cfg


def _graph_us(fn, calls) -> float:
    """Median us per call of a CUDA graph holding every call in `calls`, replayed 5 times."""
    for c in calls[:2]:
        fn(*c)  # compile and warm
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            fn(*c)
    ts = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        ts.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(ts)


def main(argv: list[str]) -> int:
    args = sweep_report.parse(argv, "fp4_decode_sweep", "tiny shapes, no timing (the interpreter on a CPU)")
    import deepinfer_kernels.triton  # noqa: F401  (registers the Triton implementations)
    from deepinfer_kernels.triton import moe_grouped as mg

    dev = "cpu" if args.smoke else "cuda"
    shapes, batches, n_exp, replays = (([("w1|w3", 128, 256)], (1, 12), 8, 1) if args.smoke
                                       else (SHAPES, BATCHES, E, REPLAYS))
    gg = REGISTRY["grouped_gemm"].impls["triton"]
    rows, real, real_ksub = [], mg._fp4_config, mg.DECODE_KSUB
    for name, N, K in shapes:
        g = torch.Generator(dev).manual_seed(N + K)
        w = torch.randint(0, 256, (n_exp, N, K // 2), device=dev, generator=g, dtype=torch.uint8).view(torch.int8)
        w_s = torch.randint(115, 122, (n_exp, N, K // 32), device=dev, generator=g).to(torch.uint8)
        for B in batches:
            calls = []
            for _ in range(replays):
                a, a_s = act_quant(torch.randn(B, K, device=dev, generator=g), 128)
                e = torch.stack([torch.randperm(n_exp, device=dev, generator=g)[:TOPK] for _ in range(B)]).view(-1)
                calls.append((a, a_s, e, w, w_s, torch.bfloat16, None, TOPK))
            ref = None
            for vname, (variant, ksub) in VARIANTS.items():
                mg._fp4_config, mg.DECODE_KSUB = _patched(mg, variant), ksub
                try:
                    out = gg(*calls[0])
                    us = None if args.smoke else _graph_us(gg, calls)
                finally:
                    mg._fp4_config, mg.DECODE_KSUB = real, real_ksub
                ref = out if ref is None else ref
                diff = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                bytes_ = len(set(calls[0][2].tolist())) * N * (K // 2 + K // 32)
                rows.append({"shape": name, "N": N, "K": K, "batch": B, "variant": vname, "config": variant, "ksub": ksub,
                             "us": us, "rel_diff_vs_shipped": diff, "nan": bool(torch.isnan(out).any()),
                             "weight_bytes": bytes_, "tb_s": bytes_ / us / 1e6 if us else None})
                r = rows[-1]
                print(f"{name} B={B} {vname:18s} " + (f"{us:8.1f} us {r['tb_s']:.2f} TB/s" if us else "(smoke)")
                      + f"  rel diff {diff:.1e}", flush=True)
    names = sweep_report.write(args.out, dev, rows)
    bad = [r for r in rows if r["nan"] or r["rel_diff_vs_shipped"] > 1e-3]
    print(f"{names}: {len(rows)} rows, {len(bad)} wrong (NaN or > 1e-3 from the shipped config)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
