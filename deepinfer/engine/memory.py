"""Memory before compute: what a request will hold, what the machine has, and the prefill chunk that fits.

A long prompt prefilled whole holds transients that grow with (chunk tokens x context): the indexer's
scores [chunk, entries] per index head, each query's gathered keys [chunk, topk + window, head_dim] and the
attention scores per head. Prefilling in chunks bounds them by the chunk, so `auto_prefill_chunk` picks the
largest chunk whose transients fit in a share of the free memory, and `check_fits` refuses up front, with the
numbers, what cannot fit at any chunk (the caches themselves, or the rope tables of an absurd length).

The estimates are upper bounds in the reference's float32 working precision; kernels hold less.
"""

from __future__ import annotations

import math
import re

import torch

from deepinfer.config import ModelConfig

GiB = 1 << 30


class MemoryRefused(ValueError):
    """A request that cannot fit in the memory available: the message has the numbers (exit code 2)."""


def fmt_bytes(n: float) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB / 10 else f"{n / (1 << 20):.0f} MiB"


def _cgroup_limit() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                v = f.read().strip()
        except OSError:
            continue
        if v.isdigit() and int(v) < 1 << 60:
            return int(v)
    return None


def available_bytes(device: str | torch.device = "cpu") -> int:
    """Free memory for this process: CUDA's free bytes on a GPU; on a CPU the smallest of MemAvailable,
    the cgroup's limit and the address-space rlimit (a `ulimit -v` is a limit too)."""
    dev = torch.device(device)
    if dev.type == "cuda":  # the device's free bytes, and what torch's allocator holds cached but unused: ours
        free, _ = torch.cuda.mem_get_info(dev)
        return int(free) + max(0, torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev))
    cands = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    cands.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    cg = _cgroup_limit()
    if cg is not None:
        cands.append(cg)
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft not in (resource.RLIM_INFINITY, -1):
            cands.append(max(0, soft - _vm_size()))
    except (ImportError, ValueError, OSError):
        pass
    return min(cands) if cands else 8 * GiB


def _vm_size() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


_ROUTED = re.compile(r".*\.experts\.\d+\.w[123]\.weight")


def model_build_bytes(cfg: ModelConfig, official: bool, dtype: torch.dtype, experts: str | None = None
                      ) -> tuple[int, int]:
    """(weights as loaded, the model's own copies) in bytes, for building `cfg` from a checkpoint or random weights.

    Loaded (`load_state`, `random_state`): FP8 weights 1 byte, FP4 half a byte, their scales decoded to float32,
    floats as the release stores them (bf16, fp32 for sinks, ape, hc_*, the router bias), int tables int64; the
    caller keeps them while the model is built. The model's copies: official numerics restack the routed experts
    (w1|w3 and w2, scales back to raw ue8m0 bytes); exact numerics dequantise every FP8 / FP4 weight to `dtype`.
    An upper bound up to the small stacked projections, checked against a build's peak RSS (docs/perf-log.md).
    experts="fp8" (official numerics): the routed FP4 experts requantised per 128 x 128 block at load
    (`load_model(experts="fp8")`), 1 byte a weight and an fp32 scale per block, both as loaded and stacked."""
    from deepinfer.checkpoint.schema import expected_tensors, fp32_in_release

    el = torch.empty((), dtype=dtype).element_size()
    loaded = own = 0
    for name, spec in expected_tensors(cfg).items():
        n = math.prod(spec.shape)
        ss = spec.scale_shape()
        ns = math.prod(ss) if ss else 0
        if spec.kind in ("fp8", "fp4"):
            routed = _ROUTED.fullmatch(name)
            if official and routed and spec.kind == "fp4" and experts == "fp8":
                n8 = n + 4 * math.ceil(spec.shape[0] / 128) * math.ceil(spec.shape[1] / 128)
                loaded += n8
                own += n8
                continue
            loaded += (n if spec.kind == "fp8" else n // 2) + 4 * ns
            if not official:
                own += n * el
            elif routed:
                own += n // 2 + ns if spec.kind == "fp4" else n + 4 * ns
        elif spec.kind == "int":
            loaded += 8 * n
        else:
            loaded += n * (4 if fp32_in_release(name) else 2)
    return loaded, own


def check_model_fits(cfg: ModelConfig, numerics, device, what: str, experts: str | None = None) -> None:
    """Refuse (MemoryRefused, with the numbers) building a model that cannot fit in the memory `device` has free,
    before any weight is read or generated: a CPU run is refused, not killed by the kernel. `what` names the model
    (a preset, a checkpoint)."""
    loaded, own = model_build_bytes(cfg, numerics.official, numerics.dtype, experts)
    have = available_bytes(device)
    form = " with experts=fp8" if experts == "fp8" else ""
    if loaded + own > 0.9 * have:
        raise MemoryRefused(
            f"{what} in {numerics.name} numerics{form} needs about {fmt_bytes(loaded + own)} on {device} to build "
            f"({fmt_bytes(loaded)} of weights as loaded, {fmt_bytes(own)} of the model's own copies), but "
            f"{fmt_bytes(have)} is available; use a smaller model or preset, or a device with more memory")


def cache_bytes(cfg: ModelConfig, rows: int, max_seq_len: int, dtype: torch.dtype, fp8_kv: bool) -> int:
    """Bytes `Transformer.allocate(rows, max_seq_len)` allocates: every attention layer's window ring and
    compressed entries, the indexer keys, the compressor states, and the two rope tables."""
    from deepinfer.quant.kv_layout import kv_packed_width

    el = torch.empty((), dtype=dtype).element_size()
    total = 2 * max_seq_len * cfg.rope_head_dim * 4  # two tables of [L, 2, rd/2] float32
    for r in cfg.compress_ratios[: cfg.n_layers + (1 if cfg.n_mtp_layers else 0)]:
        n_entries = max_seq_len // r + 1 if r else 0
        width = kv_packed_width(cfg.head_dim, cfg.rope_head_dim, dtype) if fp8_kv else cfg.head_dim * el
        total += rows * (cfg.window_size + n_entries) * width
        if r:
            coff = 2 if r == 4 else 1
            total += 2 * rows * coff * r * coff * cfg.head_dim * 4
        if r == 4:  # CSA: the indexer's key cache and its compressor
            total += rows * n_entries * cfg.index_head_dim * el + 2 * rows * 2 * r * 2 * cfg.index_head_dim * 4
    return total


def prefill_token_bytes(cfg: ModelConfig, context: int, all_logits: bool = False) -> int:
    """Transient bytes per prefilled token at `context` positions (float32 upper bound): the indexer's
    scores over every compressed entry, the gathered keys and scores of the attention, the residual
    streams and the MoE's activations; the logits when every position keeps them."""
    csa = any(r == 4 for r in cfg.compress_ratios)
    entries = context // 4 + 1 if csa else 0
    sel = cfg.window_size + (min(cfg.index_topk, entries) if csa else 0) + context // max(
        [r for r in cfg.compress_ratios if r] or [context or 1])
    per = 4 * cfg.index_n_heads * entries * 3 if csa else 0  # scores, their weighting, the top-k's copy
    per += 4 * sel * (cfg.head_dim * 2 + cfg.n_heads * 3)  # gathered kv (+ its dequantised copy), scores
    per += 4 * cfg.hc_mult * cfg.dim * 8 + 4 * cfg.n_heads * cfg.head_dim * 4
    per += 4 * cfg.n_activated_experts * cfg.moe_inter_dim * 6 + 4 * cfg.q_lora_rank * 4
    per += 4 * cfg.vocab_size * (2 if all_logits else 0)
    return per


# Share of the free memory one prefill chunk's transients may take: the rest is the caches, the weights'
# working copies and the allocator's slack.
CHUNK_BUDGET = 0.25
CHUNKS = (8192, 4096, 2048, 1024, 512, 256, 128)


def auto_prefill_chunk(cfg: ModelConfig, prompt_len: int, context: int, budget: int) -> int:
    """The prefill chunk for a prompt of `prompt_len` tokens: 0 (whole) when its transients fit in
    `budget`, else the largest of CHUNKS that fits; the smallest when none does (`check_fits` then
    decides whether to refuse)."""
    if prompt_len * prefill_token_bytes(cfg, context) <= budget:
        return 0
    for c in CHUNKS:
        if c < prompt_len and c * prefill_token_bytes(cfg, context) <= budget:
            return c
    return CHUNKS[-1]


def check_allocation(cfg: ModelConfig, rows: int, max_seq_len: int, dtype: torch.dtype, fp8_kv: bool, device,
                     held: int = 0) -> None:
    """Refuse (MemoryRefused, with the numbers) caches for `rows` sequences of `max_seq_len` positions past the
    model's context or beyond the memory `device` has free (`held` bytes of an earlier allocation are given back
    first): a model built by `engine.loader.build_model` calls this from `allocate`, so every command that runs a
    model refuses before allocating."""
    if max_seq_len > cfg.max_position_embeddings:
        raise MemoryRefused(f"{max_seq_len} positions (prompt plus decode steps) exceed the model's context of "
                            f"{cfg.max_position_embeddings}: fewer steps or a shorter prompt")
    need = max(0, cache_bytes(cfg, rows, max_seq_len, dtype, fp8_kv) - held)
    have = available_bytes(device)
    if need > 0.9 * have:
        raise MemoryRefused(f"{rows} sequence(s) of up to {max_seq_len} positions need {fmt_bytes(need)} of caches "
                            f"and rope tables, but {fmt_bytes(have)} of memory is available on {device}: fewer steps, "
                            "a shorter prompt or fewer rows")


def check_model_allocation(model, rows: int, max_seq_len: int) -> None:
    """`Transformer.allocation_check`: `check_allocation` for `model`'s config, numerics and device, its current
    caches counted as given back."""
    dtype, fp8 = model.numerics.dtype, model.numerics.official
    held = cache_bytes(model.cfg, model.rows, model.max_seq_len, dtype, fp8) if model.rows else 0
    check_allocation(model.cfg, rows, max_seq_len, dtype, fp8, model.device, held)


def check_fits(cfg: ModelConfig, rows: int, max_seq_len: int, dtype: torch.dtype, fp8_kv: bool, chunk: int,
               device, held: int = 0, prefill_graphs: bool = False) -> None:
    """Refuse (MemoryRefused, with the numbers) a request whose caches plus one prefill chunk's transients
    do not fit in the memory `device` has free; `held` bytes are already allocated and reused. prefill_graphs:
    the graphs' pool keeps a chunk's transients beside the eager first call's (`engine.prefill_runner`): twice."""
    need_cache = max(0, cache_bytes(cfg, rows, max_seq_len, dtype, fp8_kv) - held)
    need_chunk = chunk * prefill_token_bytes(cfg, max_seq_len) * (2 if prefill_graphs else 1)
    have = available_bytes(device)
    if need_cache + need_chunk > 0.9 * have:
        raise MemoryRefused(
            f"{rows} sequence(s) of up to {max_seq_len} positions need {fmt_bytes(need_cache)} of caches and "
            f"rope tables plus {fmt_bytes(need_chunk)} for a prefill chunk of {chunk} tokens"
            f"{' (twice: eager and the graph pool)' if prefill_graphs else ''}, but "
            f"{fmt_bytes(have)} of memory is available on {device}; use fewer --max-new-tokens, a shorter "
            "prompt or fewer rows (--max-batch)")
