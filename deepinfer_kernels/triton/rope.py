"""Interleaved RoPE: one program per (token, head block); pairs (2i, 2i+1) rotated in fp32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.registry import implement

from ._common import cdiv
from ._common import p2, pdl, pdl_wait, rows_2d, sms, unit_last_stride


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, S, H, HALF, CS, SS, XB, XS, XH, YB, YS, YH, INVERSE: tl.constexpr,
                 BH: tl.constexpr, BR: tl.constexpr):
    # x and y by strides (last dim contiguous): the RoPE tail of a [.., head_dim] activation is rotated
    # where it lies, and y may be x (in place: each pair is read and written by the same thread). cos / sin
    # rows by stride too (CS, SS): the two halves of one gathered [T, 2, HALF] table row.
    pdl_wait()
    t = tl.program_id(0).to(tl.int64)  # token (b, s)
    b = t // S
    sq = t % S
    hb = tl.program_id(1)
    h = hb * BH + tl.arange(0, BH)
    i = tl.arange(0, BR)
    mi = i < HALF
    c = tl.load(cos_ptr + t * CS + i, mask=mi, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * SS + i, mask=mi, other=0.0).to(tl.float32)
    if INVERSE:
        s = -s
    # each head's 2 x HALF rotated values as one contiguous [BH, 2 BR] tile (vector loads), pairs split in
    # registers; two stride-2 loads of x0 and x1 would be 2-byte accesses, several times slower at prefill
    # sizes (docs/perf-log.md, "Prefill: pre-converted expert input, 64-head attention tiles, the non-GEMM
    # kernels")
    j = tl.arange(0, 2 * BR)
    m = (h[:, None] < H) & (j[None, :] < 2 * HALF)
    xo = b * XB + sq * XS + h[:, None].to(tl.int64) * XH + j[None, :]
    yo = b * YB + sq * YS + h[:, None].to(tl.int64) * YH + j[None, :]
    x0, x1 = tl.split(tl.reshape(tl.load(x_ptr + xo, mask=m, other=0.0).to(tl.float32), [BH, BR, 2]))
    # explicit FMAs: the compiler may contract a*b - c*d either way round, and `_rms_norm_rope_kernel`
    # (whose inputs are products, not loads) must rotate with the same rounding
    y0 = tl.fma(x0, c[None, :], -(x1 * s[None, :]))
    y1 = tl.fma(x0, s[None, :], x1 * c[None, :])
    tl.store(y_ptr + yo, tl.reshape(tl.join(y0, y1), [BH, 2 * BR]).to(y_ptr.dtype.element_ty), mask=m)


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), (t.stride(2) if t.dim() == 4 else 0)


@implement("rope", "triton")
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False,
         out: torch.Tensor | None = None) -> torch.Tensor:
    R = x.size(-1)
    H = 1 if x.dim() == 3 else x.size(2)
    x = unit_last_stride(x)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    elif out.shape != x.shape or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(f"rope: out {tuple(out.shape)} {out.dtype} (last-dim stride {out.stride(-1)}) must have "
                         f"x's shape {tuple(x.shape)} and dtype {x.dtype} with a contiguous last dim")
    cos, sin = rows_2d(cos, R // 2), rows_2d(sin, R // 2)  # [B·S, R/2] rows: views of a gathered table
    S = x.size(1)
    T = x.size(0) * S
    if T == 0 or x.numel() == 0:
        return out
    # all 64 heads of a token in one program at prefill; at decode (few tokens) 16-head programs keep ~2+ per SM
    BH = min(p2(H), 64 if T * cdiv(H, 64) >= 2 * sms(x.device) else 16)
    _rope_kernel[(T, cdiv(H, BH))](x, cos, sin, out, S, H, R // 2, cos.stride(0), sin.stride(0),
                                          *_strides(x), *_strides(out),
                                          INVERSE=bool(inverse), BH=BH, BR=p2(R // 2), **pdl())
    return out


@triton.jit
def _gather_row(src_ptr, p, dst_ptr, ROW: tl.constexpr, BR: tl.constexpr):
    """dst[0:ROW] = src[p * ROW : (p + 1) * ROW]: one table row (cos then sin of position p)."""
    i = tl.arange(0, BR)
    tl.store(dst_ptr + i, tl.load(src_ptr + p * ROW + i, mask=i < ROW), mask=i < ROW)


@triton.jit
def _ratio_tables(comp_ptr, p, b, B, cs_ptr, idx_ptr, k: tl.constexpr, NR: tl.constexpr, r: tl.constexpr,
                  ROW: tl.constexpr, BR: tl.constexpr):
    """Ratio number k (= r): the compress row at max(p - (r - 1), 0) into cs[2 + k, b], p // r into idx[1 + k, b],
    (p + 1) // r into idx[1 + NR + k, b]."""
    first = tl.maximum(p - (r - 1), 0)
    _gather_row(comp_ptr, first, cs_ptr + ((2 + k) * B + b) * ROW, ROW, BR)
    tl.store(idx_ptr + (1 + k) * B + b, p // r)
    tl.store(idx_ptr + (1 + NR + k) * B + b, (p + 1) // r)


@triton.jit
def _decode_tables_kernel(pos_ptr, main_ptr, comp_ptr, cs_ptr, idx_ptr, B, WIN, NR: tl.constexpr,
                          R0: tl.constexpr, R1: tl.constexpr, R2: tl.constexpr, R3: tl.constexpr,
                          ROW: tl.constexpr, BR: tl.constexpr):
    """Row b of `reference.decode_tables`: its position's table rows and slots (positions >= 0, so C-style
    integer division and remainder are Python's). Up to four ratios, each a compile-time constant."""
    pdl_wait()
    b = tl.program_id(0).to(tl.int64)
    p = tl.load(pos_ptr + b).to(tl.int64)
    _gather_row(main_ptr, p, cs_ptr + b * ROW, ROW, BR)
    _gather_row(comp_ptr, p, cs_ptr + (B + b) * ROW, ROW, BR)
    tl.store(idx_ptr + b, p % WIN)
    if NR > 0:
        _ratio_tables(comp_ptr, p, b, B, cs_ptr, idx_ptr, 0, NR, R0, ROW, BR)
    if NR > 1:
        _ratio_tables(comp_ptr, p, b, B, cs_ptr, idx_ptr, 1, NR, R1, ROW, BR)
    if NR > 2:
        _ratio_tables(comp_ptr, p, b, B, cs_ptr, idx_ptr, 2, NR, R2, ROW, BR)
    if NR > 3:
        _ratio_tables(comp_ptr, p, b, B, cs_ptr, idx_ptr, 3, NR, R3, ROW, BR)


@implement("decode_tables", "triton")
def decode_tables(pos: torch.Tensor, main: torch.Tensor, compress: torch.Tensor, ratios: tuple[int, ...],
                  win: int) -> tuple[torch.Tensor, torch.Tensor]:
    # one launch for what the layers' memos took ~13 (flash-slice:4): a decode step's boundaries are its cost
    ratios = tuple(int(r) for r in ratios)
    if len(ratios) > 4 or any(r < 1 for r in ratios):
        raise ValueError(f"decode_tables: up to four ratios >= 1, got {ratios}")
    assert main.shape == compress.shape and main.dim() == 3 and main.size(1) == 2, (main.shape, compress.shape)
    main, compress, pos = main.contiguous(), compress.contiguous(), pos.contiguous()
    B, nr, half = pos.size(0), len(ratios), main.size(2)
    cs = torch.empty(2 + nr, B, 1, 2, half, dtype=main.dtype, device=pos.device)
    idx = torch.empty(1 + 2 * nr, B, dtype=torch.int64, device=pos.device)
    if B:
        r = ratios + (1,) * (4 - nr)
        _decode_tables_kernel[(B,)](pos, main, compress, cs, idx, B, int(win), NR=nr, R0=r[0], R1=r[1], R2=r[2],
                                    R3=r[3], ROW=2 * half, BR=p2(2 * half), **pdl())
    return cs, idx
