"""Each official kernel (kernel.py of the release in OFFICIAL_DIR, default release/60d8d707; TileLang) and each official torch step of model.py that
`official` numerics follow, against our op on the same fresh random inputs, per backend (torch, triton, and
tilelang and flaggems where installed): relative error and the fraction of bit-identical outputs.

Run on a GPU with the official files in tools/official/release/<rev>/ (README):
    PYTHONPATH=/tmp/site:$PWD python tools/official/check_kernels.py
"""
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
from deepinfer.debug import official as off  # noqa: E402

OFFICIAL_DIR = os.environ.get("OFFICIAL_DIR", os.path.join(HERE, "release", "60d8d707"))
RELEASE, _ = off.identify(OFFICIAL_DIR)  # the release by its files' sha256
off.hadamard_source()
torch.set_default_dtype(torch.bfloat16)
om = off.load_official(OFFICIAL_DIR)  # noqa: E402  (official)
ok = sys.modules["kernel"]

from deepinfer.ops.registry import REGISTRY, backend_available  # noqa: E402
from deepinfer.quant.formats import dequant_fp4  # noqa: E402,F401  (nibble order as the checkpoint's)

torch.set_default_dtype(torch.float32)
DEV = "cuda"
E8 = torch.float8_e8m0fnu


def rel(a, b):
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def same(a, b):
    return float((a.view(torch.uint8) == b.view(torch.uint8)).float().mean()) if a.dtype.itemsize == 1 else \
        float((a == b).float().mean())


def g(seed):
    return torch.Generator(DEV).manual_seed(seed)


def case_act_quant(seed=1):
    x = (torch.randn(300, 4096, device=DEV, generator=g(seed)) * 3).bfloat16()
    q, s = ok.act_quant(x, 128, "ue8m0", E8)
    return (x, 128), (q, s.float())


def _fp8_weight(N, K, seed):
    w = torch.randn(N, K, device=DEV, generator=g(seed)) * 0.05
    wb = w.unflatten(0, (-1, 128)).unflatten(-1, (-1, 128))
    amax = wb.abs().amax((1, 3), keepdim=True).clamp_min(1e-4)
    s = torch.exp2(torch.ceil(torch.log2(amax / 448)))
    wq = (wb / s).to(torch.float8_e4m3fn).flatten(2, 3).flatten(0, 1)
    return wq, s.squeeze(3).squeeze(1).float()


def case_fp8_gemm(M, seed=2):
    K, N = 4096, 1536
    x = (torch.randn(M, K, device=DEV, generator=g(seed))).bfloat16()
    a, a_s = ok.act_quant(x, 128, "ue8m0", E8)
    w, w_s = _fp8_weight(N, K, seed + 1)
    torch.set_default_dtype(torch.bfloat16)
    try:
        c = ok.fp8_gemm(a, a_s, w, w_s.to(E8), E8)
    finally:
        torch.set_default_dtype(torch.float32)
    return (a, a_s.float(), w, w_s), (c,)


def case_fp4_gemm(M, seed=3):
    K, N = 4096, 2048
    x = torch.randn(M, K, device=DEV, generator=g(seed)).bfloat16()
    a, a_s = ok.act_quant(x, 128, "ue8m0", E8)
    codes = torch.randint(0, 256, (N, K // 2), device=DEV, generator=g(seed + 1), dtype=torch.int32).to(torch.uint8)
    w_s = torch.exp2(torch.randint(-9, -4, (N, K // 32), device=DEV, generator=g(seed + 2)).float())
    torch.set_default_dtype(torch.bfloat16)
    try:
        c = ok.fp4_gemm(a, a_s, codes.view(torch.float4_e2m1fn_x2), w_s.to(E8), E8)
    finally:
        torch.set_default_dtype(torch.float32)
    return (a, a_s.float(), codes.view(torch.int8), w_s), (c,)


def case_sparse_attn(S, N, K, seed=4):
    H, D = 64, 512
    q = torch.randn(1, S, H, D, device=DEV, generator=g(seed)).bfloat16()
    kv = torch.randn(1, N, D, device=DEV, generator=g(seed + 1)).bfloat16()
    sink = torch.randn(H, device=DEV, generator=g(seed + 2)).float()
    idx = torch.argsort(torch.rand(1, S, N, device=DEV, generator=g(seed + 3)), -1)[..., :K].int()
    scale = D ** -0.5
    o = ok.sparse_attn(q, kv, sink, idx, scale)
    return (q, kv, sink, idx, scale), (o,)


def case_hc_pre(T, seed=5):
    hc, D, iters, eps = 4, 4096, 20, 1e-6
    x = torch.randn(1, T, hc, D, device=DEV, generator=g(seed)).bfloat16()
    fn = torch.randn((2 + hc) * hc, hc * D, device=DEV, generator=g(seed + 1)) * 0.01
    scale = torch.rand(3, device=DEV, generator=g(seed + 2)) + 0.5
    base = torch.randn((2 + hc) * hc, device=DEV, generator=g(seed + 3)) * 0.1
    xf = x.flatten(2).float()
    mixes = torch.nn.functional.linear(xf, fn) * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6)
    pre, post, comb = ok.hc_split_sinkhorn(mixes, scale, base, hc, iters, eps)
    y = torch.sum(pre.unsqueeze(-1) * x.float(), dim=2).to(x.dtype)  # model.py Block.hc_pre
    return (x, fn, scale, base, 1e-6, eps, iters), (y, post, comb)


def case_hc_post(T, seed=6):
    hc, D = 4, 4096
    x = torch.randn(1, T, D, device=DEV, generator=g(seed)).bfloat16()
    res = torch.randn(1, T, hc, D, device=DEV, generator=g(seed + 1)).bfloat16()
    post = torch.rand(1, T, hc, device=DEV, generator=g(seed + 2)) * 2
    comb = torch.rand(1, T, hc, hc, device=DEV, generator=g(seed + 3))
    y = (post.unsqueeze(-1) * x.unsqueeze(-2) + torch.sum(comb.unsqueeze(-1) * res.unsqueeze(-2), dim=2)).type_as(x)
    return (x, res, post, comb), (y,)


def case_head_norm_rope(T, seed=7):
    H, D, rd = 64, 512, 64
    q = torch.randn(1, T, H, D, device=DEV, generator=g(seed)).bfloat16() * 2
    pos = torch.arange(T, device=DEV).float()
    inv = 1.0 / (10000 ** (torch.arange(0, rd, 2, device=DEV).float() / rd))
    ang = torch.outer(pos, inv)
    fc = torch.polar(torch.ones_like(ang), ang)
    ref = q.clone()
    ref *= torch.rsqrt(ref.square().mean(-1, keepdim=True) + 1e-6)  # model.py: in bf16
    om.apply_rotary_emb(ref[..., -rd:], fc)
    cos, sin = ang.cos()[None], ang.sin()[None]
    return (q, None, 1e-6, cos, sin, rd), (ref,), {"form": "official_q"}


CASES = [
    ("act_quant", "300x4096", case_act_quant),
    ("fp8_gemm", "M=1", lambda: case_fp8_gemm(1)), ("fp8_gemm", "M=64", lambda: case_fp8_gemm(64)),
    ("fp8_gemm", "M=4096", lambda: case_fp8_gemm(4096)),
    ("fp4_gemm", "M=1", lambda: case_fp4_gemm(1)), ("fp4_gemm", "M=512", lambda: case_fp4_gemm(512)),
    ("sparse_attn", "S=1 N=4096 K=640", lambda: case_sparse_attn(1, 4096, 640)),
    ("sparse_attn", "S=512 N=1024 K=256", lambda: case_sparse_attn(512, 1024, 256)),
    ("hc_pre", "T=1", lambda: case_hc_pre(1)), ("hc_pre", "T=512", lambda: case_hc_pre(512)),
    ("hc_post", "T=512", lambda: case_hc_post(512)),
    ("rms_norm_rope", "q heads T=64", lambda: case_head_norm_rope(64)),
]


@torch.inference_mode()
def main():
    backends = ["torch"] + [b for b in ("triton", "tilelang", "flaggems") if backend_available(b)[0]]
    print(f"{'op':<14} {'case':<20} " + " ".join(f"{b + ' rel':>13} {b + ' same':>13}" for b in backends))
    for op, label, make in CASES:
        made = make()
        args, want = made[0], made[1]
        kw = made[2] if len(made) > 2 else {}
        cells = []
        for b in backends:
            fn = REGISTRY[op].impls.get(b)
            if fn is None:
                cells.append(f"{'-':>13} {'-':>13}")
                continue
            got = fn(*args, **kw)
            got = got if isinstance(got, tuple) else (got,)
            r = max(rel(x, w) for x, w in zip(got, want))
            sm = min(same(x, w) for x, w in zip(got, want))
            cells.append(f"{r:13.2e} {100 * sm:12.3f}%")
        print(f"{op:<14} {label:<20} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
