"""KV cache writes: the scatter cache[rows[i], slots[i]] = values[i] (one program per (entry, column block);
into an FP8-layout cache each entry is packed on the way, one program per entry), and `kv_pack` /
`kv_unpack`, entries into and out of the FP8 KV layout (one program per entry)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.registry import implement
from deepinfer.quant.kv_layout import kv_packed_width, kv_rope_offset

from ._common import cdiv
from ._common import e8m0_f32, p2, pdl, pdl_wait, quant_e4m3_rows


@triton.jit
def _kv_store_kernel(cache_ptr, rows_ptr, slots_ptr, v_ptr, NSLOT, D, s_c0, s_c1, BD: tl.constexpr):
    pdl_wait()
    i = tl.program_id(0).to(tl.int64)
    db = tl.program_id(1)
    d = db * BD + tl.arange(0, BD)
    r = tl.load(rows_ptr + i).to(tl.int64)
    s = tl.load(slots_ptr + i).to(tl.int64)
    v = tl.load(v_ptr + i * D + d, mask=d < D)
    tl.store(cache_ptr + r * s_c0 + s * s_c1 + d, v.to(cache_ptr.dtype.element_ty), mask=d < D)


@triton.jit
def _kv_pack_store_kernel(cache_ptr, cacher_ptr, rows_ptr, slots_ptr, v_ptr, D, NOPE, NB, s_c0, s_c1, ES, ROFF, RD,
                          BNB: tl.constexpr, BR: tl.constexpr, SB: tl.constexpr):
    """Entry i packed (`_pack_entry`) straight into cache[rows[i], slots[i]] (cacher: the cache viewed in the
    values' dtype, ES bytes an element; s_c0, s_c1 byte strides)."""
    pdl_wait()
    i = tl.program_id(0).to(tl.int64)
    base = tl.load(rows_ptr + i).to(tl.int64) * s_c0 + tl.load(slots_ptr + i).to(tl.int64) * s_c1
    _pack_entry(v_ptr + i * D, cache_ptr + base, cacher_ptr + base // ES + ROFF, NOPE, NB, RD, BNB, BR, SB)


@implement("kv_store", "triton")
def kv_store(cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, values: torch.Tensor,
             rope_dim: int = 0) -> None:
    M = rows.numel()
    D = cache.size(-1)
    assert cache.stride(-1) == 1, "kv_store: the cache's last dim must be contiguous"
    if M == 0 or D == 0:
        return None
    if rope_dim:  # FP8-layout cache: pack each entry into its slot (one launch instead of kv_pack + kv_store)
        HD = values.size(-1)
        nope = HD - rope_dim
        es = values.element_size()
        W = kv_packed_width(HD, rope_dim, values.dtype)
        assert cache.dtype == torch.uint8 and D == W and nope > 0 and nope % 64 == 0, \
            f"kv_store: rope_dim {rope_dim} needs a uint8 [.., {W}] FP8-layout cache for {HD}-dim values, " \
            f"got {cache.dtype} [.., {D}]"
        assert cache.stride(0) % es == 0 and cache.stride(1) % es == 0 and cache.data_ptr() % es == 0
        values = values.reshape(M, HD).contiguous()
        roff = kv_rope_offset(HD, rope_dim)
        _kv_pack_store_kernel[(M,)](cache, cache.view(values.dtype), rows.contiguous(), slots.contiguous(), values,
                                    HD, nope, nope // 64, cache.stride(0), cache.stride(1), es, roff // es,
                                    rope_dim, BNB=p2(nope // 64), BR=p2(rope_dim), SB=roff - nope, **pdl())
        return None
    values = values.reshape(M, D).contiguous()
    BD = min(p2(D), 1024)
    _kv_store_kernel[(M, cdiv(D, BD))](cache, rows.contiguous(), slots.contiguous(), values,
                                              cache.size(1), D, cache.stride(0), cache.stride(1), BD=BD,
                                              **pdl())
    return None


@triton.jit
def _pack_entry(x_row, out_row, outr_row, NOPE, NB, RD, BNB: tl.constexpr, BR: tl.constexpr, SB: tl.constexpr):
    """One entry x_row[0 : NOPE + RD] into the FP8 layout at out_row (bytes): its NOPE dims as an [NB, 64]
    tile quantised per row (act_quant's rule), codes and e8m0 scale bytes stored, scale padding zeroed; the RD
    rope dims copied in their dtype to outr_row (the rope part's address, in x's dtype)."""
    blk = tl.arange(0, BNB)
    cols = blk[:, None] * 64 + tl.arange(0, 64)[None, :]
    m = blk[:, None] < NB
    x = tl.load(x_row + cols, mask=m, other=0.0).to(tl.float32)
    q, s = quant_e4m3_rows(x)
    code = q.to(tl.uint8, bitcast=True)
    tl.store(out_row + cols, tl.where(code == 0x80, 0, code), mask=m)  # -0 stored as +0 (reference)
    sbyte = tl.where(blk < NB, (s.to(tl.int32, bitcast=True) >> 23) & 0xFF, 0)
    j = tl.arange(0, SB)
    sb = tl.sum(tl.where(j[:, None] == blk[None, :], sbyte[None, :], 0), 1)  # scale j, 0 past NB
    tl.store(out_row + NOPE + j, sb.to(tl.uint8))
    r = tl.arange(0, BR)
    tl.store(outr_row + r, tl.load(x_row + NOPE + r, mask=r < RD), mask=r < RD)


@triton.jit
def _kv_pack_kernel(kv_ptr, out_ptr, outr_ptr, D, NOPE, NB, W, WE, ROFF, RD,
                    BNB: tl.constexpr, BR: tl.constexpr, SB: tl.constexpr):
    """Entry i (`_pack_entry`) into row i of out (outr = out viewed as kv's dtype: WE elements a row, rope from
    element ROFF)."""
    pdl_wait()
    i = tl.program_id(0).to(tl.int64)
    _pack_entry(kv_ptr + i * D, out_ptr + i * W, outr_ptr + i * WE + ROFF, NOPE, NB, RD, BNB, BR, SB)


@implement("kv_pack", "triton")
def kv_pack(kv: torch.Tensor, rope_dim: int) -> torch.Tensor:
    D = kv.size(-1)
    nope = D - rope_dim
    assert nope > 0 and nope % 64 == 0, f"kv_pack: {nope} no-RoPE dims are not a positive multiple of 64"
    W = kv_packed_width(D, rope_dim, kv.dtype)
    es = kv.element_size()
    kvc = kv.contiguous()
    out = torch.empty(*kv.shape[:-1], W, dtype=torch.uint8, device=kv.device)
    M = kvc.numel() // D
    if M:
        roff = kv_rope_offset(D, rope_dim)
        _kv_pack_kernel[(M,)](kvc, out, out.view(kv.dtype), D, nope, nope // 64, W, W // es, roff // es,
                              rope_dim, BNB=p2(nope // 64), BR=p2(rope_dim), SB=roff - nope, **pdl())
    return out


@triton.jit
def _kv_unpack_kernel(p_ptr, pr_ptr, out_ptr, D, NOPE, NB, W, WE, ROFF, RD, BNB: tl.constexpr, BR: tl.constexpr):
    """One entry: codes [NB, 64] times their e8m0 scale bytes, cast to out's dtype; rope dims copied
    (pr = the packed rows viewed in out's dtype: WE elements a row, rope from element ROFF)."""
    pdl_wait()
    i = tl.program_id(0).to(tl.int64)
    blk = tl.arange(0, BNB)
    cols = blk[:, None] * 64 + tl.arange(0, 64)[None, :]
    m = blk[:, None] < NB
    code = tl.load(p_ptr + i * W + cols, mask=m, other=0)
    sc = e8m0_f32(tl.load(p_ptr + i * W + NOPE + blk, mask=blk < NB, other=0))
    v = code.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc[:, None]
    tl.store(out_ptr + i * D + cols, v.to(out_ptr.dtype.element_ty), mask=m)
    r = tl.arange(0, BR)
    tl.store(out_ptr + i * D + NOPE + r, tl.load(pr_ptr + i * WE + ROFF + r, mask=r < RD), mask=r < RD)


@implement("kv_unpack", "triton")
def kv_unpack(packed: torch.Tensor, head_dim: int, rope_dim: int, dtype: torch.dtype) -> torch.Tensor:
    nope = head_dim - rope_dim
    W = kv_packed_width(head_dim, rope_dim, dtype)
    assert packed.dtype == torch.uint8 and packed.size(-1) == W, \
        f"kv_unpack: expected uint8 [..., {W}] for head_dim {head_dim}, got {packed.dtype} {list(packed.shape)}"
    pc = packed.contiguous()
    out = torch.empty(*packed.shape[:-1], head_dim, dtype=dtype, device=packed.device)
    M = pc.numel() // W
    if M:
        es = out.element_size()
        _kv_unpack_kernel[(M,)](pc, pc.view(dtype), out, head_dim, nope, nope // 64, W, W // es,
                                kv_rope_offset(head_dim, rope_dim) // es, rope_dim, BNB=p2(nope // 64), BR=p2(rope_dim),
                                **pdl())
    return out
