"""The folded FP4 GEMM's warp-specialised forms at the flash w1|w3 prefill shape (24 576 rows x 4096 x 4096, E 256,
uniform routing, 128-row blocks), each launched once, for Nsight Compute to profile:
    ncu --clock-control none --set full --import-source yes -k regex:grouped_fp4_fold --launch-count 3 \
        -o fp4 python tools/device/fp4_profile.py ws pp ws5
Needs TileLang and the backend importable as `deepinfer_kernels` (see tools/tilelang_lower.py)."""
import sys

import tilelang
import torch

from deepinfer.ops.reference import act_quant
from deepinfer_kernels.tilelang import grouped_fp4, grouped_fp4_ws as ws
from deepinfer_kernels.tilelang._common import expert_blocks

FORMS = {"ws": ws.grouped_fp4_fold_ws_kernel, "pp": ws.grouped_fp4_fold_pp_kernel,
         "ws5": ws.grouped_fp4_fold_ws5_kernel}


def main(names):
    dev, E, P, N, K = "cuda", 256, 24576, 4096, 4096
    g = torch.Generator(dev).manual_seed(P + N + K)
    w = torch.randint(0, 256, (E * N, K // 2), device=dev, generator=g, dtype=torch.uint8)
    ws32 = torch.randint(115, 122, (E * N, K // 32), device=dev, generator=g).to(torch.uint8).view(torch.int32)
    a, a_s = act_quant(torch.randn(P, K, device=dev, generator=g), 128)
    e = torch.randint(0, E, (P,), device=dev, generator=g)
    BM = grouped_fp4.block_rows(P, E)
    c, rows, bexp = expert_blocks(e, P, N, E, BM, torch.bfloat16)
    for name in names:
        k = tilelang.compile(FORMS[name](E, N, K, "bfloat16", BM), out_idx=[], pass_configs=ws.PASS_CONFIGS)
        k(a, a_s.float().contiguous(), w, ws32, rows.view(-1, BM), bexp, c)
        torch.cuda.synchronize()
        print(name, "ran", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or list(FORMS))
