"""Helpers shared by the Triton kernels: sizes, dtype maps and in-kernel numerics primitives."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from deepinfer import settings

FP8_MAX = 448.0
FP4_MAX = 6.0

INTERPRET = settings.triton_interpreted()
"""Kernels run by Triton's CPU interpreter (whose bf16 tl.dot is wrong: callers feed it fp32)."""

PDL_ENV = "DEEPINFER_PDL"
_PDL_ON = settings.flag(PDL_ENV)
try:  # a Triton with grid dependency control (3.6 and 3.9 have it); releases or forks without it launch plainly
    from triton.language.extra.cuda import gdc_wait
    from triton.language.target_info import cuda_capability_geq
    from triton.backends.nvidia.compiler import CUDAOptions
    _PDL_TRITON = "launch_pdl" in CUDAOptions.__dataclass_fields__
except ImportError:
    _PDL_TRITON = False


@functools.lru_cache(maxsize=None)
def _sm90_nvidia_index(index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(index) >= (9, 0)


def sm90_nvidia(device: torch.device | None = None) -> bool:
    """An NVIDIA (not ROCm) CUDA device of compute capability 9.0+ (`device`, else the current one): what
    PTX-level features need (griddepcontrol, mul.bf16x2). Cached per device index."""
    if device is not None and device.type != "cuda":
        return False
    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    return _sm90_nvidia_index(index)


def pdl() -> dict:
    """Launch options for every launch of this package (`kernel[grid](..., **pdl())`): {"launch_pdl": True}
    -- programmatic dependent launch: the next kernel in the stream or graph is launched while this one
    drains, and waits in `pdl_wait` for its completion -- or {} (plain launch).

    PDL on sm_90+ CUDA devices (the current one: Triton launches there) with a Triton that has it, unless
    DEEPINFER_PDL=0; plain under the interpreter, on ROCm and on older Triton, which reject the
    `launch_pdl` keyword even when false (hence a dict, not a flag). Every kernel launched with it calls
    `pdl_wait()` before anything else, so no read or write moves ahead of the previous kernel's
    (tests/test_pdl.py checks both sides).

    Why (docs/perf-log.md, "Programmatic dependent launch, rank top-k" has the measurements):
    * in chains of dependent kernels in a CUDA graph it shortens every kernel boundary;
    * at flash-slice:4 decode (graphs) it pays at batch 1 only when every launch takes it (PDL for captured
      launches alone gains nothing), so every launch takes it; larger batches and eager prefill TTFT show no
      change beyond their run-to-run spread.
    * No kernel triggers its successor early (`gdc_launch_dependents`): the successor's waiting programs
      hold SM slots. Triggered after the wait, batch-1 decode and multi-block GEMV chains are slower;
      triggered before it, the whole chain launches at once and is slower still."""
    if _PDL_ON and _PDL_TRITON and not INTERPRET and sm90_nvidia():
        return _PDL_LAUNCH
    return _PLAIN_LAUNCH


_PDL_LAUNCH, _PLAIN_LAUNCH = {"launch_pdl": True}, {}


if _PDL_TRITON:
    @triton.jit
    def pdl_wait():
        """The first statement of every kernel: under programmatic dependent launch, wait until the previous
        kernel has completed and its writes are visible (a no-op when launched without it); sm_90+ only
        (`griddepcontrol`), compiled out elsewhere and under the interpreter."""
        if cuda_capability_geq(9, 0):
            gdc_wait()
else:
    @triton.jit
    def pdl_wait():
        """No PDL in this Triton (`pdl()` launches plainly): nothing to wait for."""


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (132 on an H200; the same guess on CPU for the interpreter)."""
    if device.type == "cuda":
        return _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 132


def cdiv(x: int, y: int) -> int:
    """ceil(x / y) of host integers: `triton.cdiv` without its constexpr wrapper. Triton (3.6, 3.8) makes
    `triton.cdiv` and `triton.next_power_of_2` constexpr functions, so each host call unwraps its arguments as
    constexprs first: ~5 us a call on a 2-core Xeon, where the arithmetic is ~0.1 us, and a prefill's wrappers
    made ~700 such calls (a third of their host time, the kernels themselves aside)."""
    return (x + y - 1) // y


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n for host integers n >= 1 (0 for n <= 0), as `triton.next_power_of_2`
    computes it, without its constexpr wrapper (see `cdiv`)."""
    n = int(n)
    return 1 << (n - 1).bit_length() if n > 0 else 0


def p2(n: int) -> int:
    """Next power of two >= max(n, 1) (Triton block sizes must be powers of two)."""
    return next_power_of_2(max(int(n), 1))


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """t itself when its last dim is contiguous (any other strides: kernels take row strides), else a
    contiguous copy."""
    return t if t.stride(-1) == 1 or t.size(-1) <= 1 else t.contiguous()


def rows_2d(t: torch.Tensor, n: int) -> torch.Tensor:
    """t [..., n] as [M, n] rows with a unit column stride: a view (any row stride) when the leading dims
    merge, else a copy."""
    return unit_last_stride(t.reshape(-1, n))


def tma_ok(t: torch.Tensor) -> bool:
    """TMA tensor descriptors on t's device: sm_90+ (the interpreter emulates them, so CPU tests cover the
    kernels that use them)."""
    return INTERPRET or (t.is_cuda and torch.cuda.get_device_capability(t.device)[0] >= 9)


def tf32_exact(t: torch.Tensor) -> bool:
    """Every value of t is exact in tf32 (bf16 / fp16: <= 10 mantissa bits): `dot_f32`'s X_TF32."""
    return t.dtype in (torch.bfloat16, torch.float16)


@triton.jit
def round_bf16(x):
    """float32 x rounded to the nearest bf16 (ties to even), returned as float32: what `.to(tl.bfloat16)` does on
    a GPU, spelled out in bits because Triton's CPU interpreter truncates that conversion instead."""
    b = x.to(tl.int32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    return b.to(tl.float32, bitcast=True)


@triton.jit
def tf32_hi(x):
    """float32 x with its low 13 mantissa bits cleared: the top 10 (tf32-exact); x - tf32_hi(x) is the rest."""
    return (x.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)


@triton.jit
def dot_f32(x, w, acc, X_TF32: tl.constexpr, W_TF32: tl.constexpr = False):
    """acc + x . w for float32 operands, fp32-accurate on tensor cores. X_TF32 (every x value exact in tf32:
    bf16 / fp16 inputs): w = hi + lo, two tf32 dots -- x . hi exact, lo rounded to tf32 (~2^-21 |w|) -- with
    no split of x; W_TF32 likewise with the roles swapped; both: one tf32 dot of exact products; neither:
    Triton's 3xTF32 (x and w split, three dots)."""
    if X_TF32 and W_TF32:
        return tl.dot(x, w, acc, input_precision="tf32")
    if W_TF32:
        x_hi = tf32_hi(x)
        acc = tl.dot(x_hi, w, acc, input_precision="tf32")
        return tl.dot(x - x_hi, w, acc, input_precision="tf32")
    if X_TF32:
        w_hi = tf32_hi(w)
        acc = tl.dot(x, w_hi, acc, input_precision="tf32")
        return tl.dot(x, w - w_hi, acc, input_precision="tf32")
    return tl.dot(x, w, acc, input_precision="tf32x3")


@triton.jit
def pow2_ceil(x):
    """2^ceil(log2 x) for positive *normal* float32 x, exactly, from the float bits.

    Every caller clamps x >= 2^-126 first (FP8 amax floor 1e-4/448, FP4 floor 6*2^-126 / 6), where this
    equals the reference's frexp form.
    """
    bits = x.to(tl.int32, bitcast=True)
    e = (bits >> 23) & 0xFF
    e = e + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def round_e4m3(x):
    """Round float32 x (already clamped to [-448, 448]) to the nearest e4m3 value, ties to even.

    The result is exactly representable, so the following `.to(tl.float8e4nv)` is exact on every
    backend. Needed because the Triton interpreter's fp32 -> fp8 cast rounds half-up and drops the
    mantissa carry (127.2 -> 64); on the GPU it is a few ALU ops per element and bit-identical to
    the hardware RN cast.
    """
    bits = x.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    ue = tl.maximum(e, -6) - 3  # 3 mantissa bits; below 2^-6 the subnormal spacing 2^-9
    ulp = ((ue + 127) << 23).to(tl.float32, bitcast=True)
    y = x / ulp  # exact: ulp is a power of two, |y| < 16
    r = (y + 12582912.0) - 12582912.0  # round to nearest even integer (1.5 * 2^23 magic)
    return r * ulp


@triton.jit
def sort_key(x, idx):
    """A distinct int64 key per (float32 value, index): larger value first, then LOWER index first.

    key = ord(x) * 2^31 + (2^31 - 1 - idx) with ord an order-preserving map of float32 into [0, 2^32)
    (-0.0 canonicalised to +0.0 so the two zeros tie as in torch.sort; NaN canonicalised to +NaN, above
    +inf, as torch.sort ranks NaN). Keys are >= 0, so -1 marks "no entry". idx must be < 2^31.
    """
    x = tl.where(x == 0.0, 0.0, x)
    x = tl.where(x != x, float("nan"), x)
    b = x.to(tl.int32, bitcast=True).to(tl.int64)
    nanbits = tl.full(b.shape, 0x7FC00000, tl.int64)
    b = tl.where(x != x, nanbits, b)
    u = tl.where(b >= 0, b + 2147483648, 2147483647 - (b & 2147483647))
    return u * 2147483648 + (2147483647 - idx.to(tl.int64))


@triton.jit
def key_index(key):
    """The index encoded in a sort_key (meaningless for the -1 "no entry" key)."""
    return 2147483647 - (key & 2147483647)


def split_k(k_blocks: int, tiles: int, target: int) -> tuple[int, int]:
    """Split a reduction of `k_blocks` blocks so that `tiles` output tiles x splits ~ `target` programs.

    Returns (blocks per split, number of splits); every split but the last has exactly `per` blocks and
    none is empty. Depends only on shapes (and the device's SM count), so grids stay graph-capturable.
    """
    k_blocks = max(int(k_blocks), 1)
    want = max(1, min(k_blocks, -(-int(target) // max(int(tiles), 1))))
    per = -(-k_blocks // want)
    return per, -(-k_blocks // per)


@triton.jit
def e8m0_f32(b):
    """Raw ue8m0 scale bytes (any int type) -> 2^(b - 127) as float32 from the exponent bits (b = 0 -> 0)."""
    return (b.to(tl.int32) << 23).to(tl.float32, bitcast=True)


def weight_scale_arg(w_s: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A weight scale as a kernel argument: (raw ue8m0 bytes as uint8, True) or (float32, False), contiguous."""
    e8m0 = w_s.dtype in (torch.uint8, torch.float8_e8m0fnu)
    return (w_s.view(torch.uint8) if e8m0 else w_s.float()).contiguous(), e8m0


@triton.jit
def quant_e4m3_rows(v):
    """act_quant of R blocks at once, v [R, B] float32 (one block a row): (q [R, B] float8e4nv, s [R]) with the
    reference's rule -- amax floored at 1e-4, s = pow2_ceil(amax / 448), q = round-to-nearest-even(clamp(v / s))
    (exact division by a power of two)."""
    amax = tl.maximum(tl.max(tl.abs(v), 1), 1e-4)
    s = pow2_ceil(tl.math.div_rn(amax, 448.0))
    q = round_e4m3(tl.minimum(tl.maximum(v / s[:, None], -448.0), 448.0)).to(tl.float8e4nv)
    return q, s


@triton.jit
def store_bf16_split(o_starts, q, s, m, QB: tl.constexpr):
    """Store R act_quant'd blocks (q [R, QB] e4m3, s [R] their scales) as the FP4 expert GEMM reads its input:
    q x s in bf16 (exact), each block's QB/2 even then QB/2 odd columns, block i from o_starts[i] (pointers
    [R]). m [R, 1]: the blocks to store. `moe_grouped.a_bf16_split` and the producers that write this form
    (swiglu_quant, rms_norm_quant, hc_pre_quant with split) all store through here."""
    a_e, a_o = tl.split(tl.reshape(q.to(tl.float32) * s[:, None], [q.shape[0], QB // 2, 2]))
    o = o_starts[:, None] + tl.arange(0, QB // 2)[None, :]
    tl.store(o, a_e.to(tl.bfloat16), mask=m)
    tl.store(o + QB // 2, a_o.to(tl.bfloat16), mask=m)


@triton.jit
def swiglu_f32(g, u, w, limit, CLAMP: tl.constexpr, WEIGHT: tl.constexpr):
    """silu(min(g, limit)) * clamp(u, -limit, limit) [* w] in float32: the one expression of the SwiGLU kernels
    and of the grouped GEMM that computes it as it loads its A blocks (the same bits in each)."""
    g = g.to(tl.float32)
    u = u.to(tl.float32)
    if CLAMP:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    y = g / (1.0 + tl.exp(-g)) * u
    if WEIGHT:
        y = w.to(tl.float32) * y
    return y


@triton.jit
def store_act_quant(v, q_row, s_row, o_row, blk, m, NB, QB: tl.constexpr, SPLIT: tl.constexpr):
    """act_quant of R blocks of a row, v [R, QB] float32 (`quant_e4m3_rows`), stored: the codes of block blk[i]
    at q_row + blk[i] * QB, its scale at s_row + blk[i]; SPLIT (QB 128) also the FP4 experts' input form at
    o_row (`store_bf16_split`). m [R, 1]: the blocks < NB. The norm, hc and SwiGLU kernels that quantise
    their output for the next GEMM all store through here."""
    q, s = quant_e4m3_rows(v)
    tl.store(q_row + blk[:, None] * QB + tl.arange(0, QB)[None, :], q, mask=m)
    tl.store(s_row + blk, s, mask=blk < NB)
    if SPLIT:
        store_bf16_split(o_row + blk * QB, q, s, m, QB)


@triton.jit
def e2m1_x2p14(code):
    """4-bit e2m1 codes (int32, 0..15) -> float32 value * 2^-14, exactly, in 6 integer/convert ops.

    (code & 7) << 9 is the fp16 bit pattern with exponent field e (code bits 1..2) and top mantissa
    bit m (code bit 0): 2^(e-15) (1 + m/2), or the subnormal m 2^-15 for e = 0 -- the e2m1 value
    2^(e-1) (1 + m/2) (resp. m/2) times 2^-14; code bit 3 is the sign (fp16 bit 15). fp16 -> fp32 is
    exact, subnormals included. (The where-chain decode took ~15 ops per element, and the kernel is
    bound by these per-element instructions, not by HBM.)
    """
    h = ((code & 7) << 9) | ((code & 8) << 12)
    return h.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def splitk_store(acc, p_ptrs, c_ptrs, mask, split, n_splits, slab, cnt_ptr):
    """Split-K epilogue inside the GEMM: no reduction launch.

    Stores this split's fp32 partial `acc` at `p_ptrs + split * slab` (p_ptrs: split 0's addresses of the
    tile, slab: elements per split); the program that completes the tile -- the one whose increment of
    the tile's counter at `cnt_ptr` returns n_splits - 1 -- sums the n_splits partials in split order
    (the same sum whichever program finishes last: deterministic) into `c_ptrs`, cast to their dtype,
    and re-arms the counter to 0 for the next launch or graph replay. The barrier puts every thread's
    partial store before the release increment (the CUTLASS semaphore pattern: syncthreads, then one
    thread's gpu-scope atomic); the acquire side reads the partials with .cg, from L2.
    Counters come from `tile_counters`, one set per stream (every launch leaves them 0).
    """
    tl.store(p_ptrs + split.to(tl.int64) * slab, acc, mask=mask)
    tl.debug_barrier()
    done = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    if done == n_splits - 1:
        tot = tl.zeros_like(acc)
        for _ in range(0, n_splits):
            tot += tl.load(p_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
            p_ptrs += slab
        tl.store(c_ptrs, tot.to(c_ptrs.dtype.element_ty), mask=mask)
        tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")


TILE_COUNTERS = 1 << 14
_counters: dict = {}


def tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The int32 [TILE_COUNTERS] split-K tile counters of the current stream on `device` (zero; `splitk_store`
    leaves them zero).

    Split-K runs only while output tiles are fewer than ~2 per SM (`split_k`), so a launch needs a few
    hundred counters at most. One set per stream: kernels of one stream run one after another (every one
    waits for its predecessor), while a decode step's second stream (`deepinfer.model.branch`) runs its
    kernels beside them, which must not count into the same tiles. Allocated by a stream's first split
    launch (the decode warm-up runs before any graph capture, on the streams the capture uses)."""
    if tiles > TILE_COUNTERS:
        raise ValueError(f"split-K over {tiles} output tiles: more than the {TILE_COUNTERS} tile counters")
    key = (device.type, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    c = _counters.get(key)
    if c is None:
        c = _counters[key] = torch.zeros(TILE_COUNTERS, dtype=torch.int32, device=device)
    return c


def split_buffers(c: torch.Tensor, splits: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 partials [splits, *c.shape], tile counters) for a split-K launch into c over `tiles` output
    tiles; (c, c) -- unused placeholders -- when the reduction is not split."""
    if splits == 1:
        return c, c
    part = torch.empty(splits, *c.shape, dtype=torch.float32, device=c.device)
    return part, tile_counters(c.device, tiles)


@triton.jit
def expert_block_tile(rows_ptr, pid_m, pid_n, P, N, BM: tl.constexpr, BN: tl.constexpr, IDENT: tl.constexpr = False):
    """Rows and columns of one (expert block pid_m, N tile pid_n) program of a grouped GEMM over
    `moe_align`'s layout: rows [BM] int64 (the block's sorted A rows; >= P is padding), their mask mr [BM],
    the tile's columns rn [BN] int64 and mask mn [BN]. IDENT (a handful of unsorted rows): block pid_m is row
    pid_m alone, the rest padding, rows_ptr unread. The caller loads the block's expert first and returns on -1
    (an unused block; under IDENT after `zero_row_tile`)."""
    if IDENT:
        rows = tl.where(tl.arange(0, BM) == 0, pid_m, P).to(tl.int64)
    else:
        rows = tl.load(rows_ptr + pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    mr = rows < P
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    mn = rn < N
    return rows, mr, rn, mn


@triton.jit
def zero_row_tile(c_ptr, row, pid_n, N, BN: tl.constexpr):
    """Output row `row`'s columns of N tile pid_n stored as 0: an IDENT block whose row has no local expert (the
    output is not zero-filled beforehand)."""
    rz = pid_n * BN + tl.arange(0, BN)
    tl.store(c_ptr + row * N + rz, tl.zeros([BN], tl.float32).to(c_ptr.dtype.element_ty), mask=rz < N)
