"""`deepinfer bench`: measured prefill / decode speed against floors computed from the model's bytes and FLOPs.

What is measured (on the chosen device, in this process):

* TTFT: one prefill of a `prompt_len`-token prompt into cache row 0 (this engine prefills per prompt, so
  time to first token = one prefill + LM head), median of 3 after one warm-up call; prefill tokens/s.
* decode: for each batch size B, B rows are prefilled, then `gen_len` steps of
  `model.decode(ids [B, 1], positions [B], rows)` run back to back (2 warm-up steps first), timed with
  perf_counter between device synchronisations: ms/step and B*1000/ms tokens/s; peak device memory.
* the device: copy bandwidth (a large device-to-device copy, bytes read + written / time) and the dense
  matmul rate (8192^3 bf16 on GPU, 1024^3 fp32 on CPU). Floors use these measured numbers, not specs.

Floors (a lower bound on the step time for this model and batch, never a measurement):

* bytes: what one step must read at least. Per main layer: its attention, shared expert, router, norms
  and mHC tensors; routed experts: E(1-(1-k/E)^T) distinct experts expected for T = B tokens x top-k over
  E experts (uniform routing), each at its size; the LM head; B embedding rows; the KV / compressed
  entries each row reads (window + HCA entries, or CSA top-k + indexer keys). Counted twice:
  `ckpt` = tensors in their checkpoint formats (FP8 1 B + 1 B e8m0 per 128x128 block, FP4 0.5 B + 1 B per
  32, bf16 floats, fp32 where the release stores fp32, LM head as bf16) = what an ideal kernel reads;
  `engine` = the bytes this engine actually holds for the same tensors (fp32 scales, fp32 LM head, bf16
  `wo_a`, fp32 compressor weights...). The MTP block is not run by decode and is not counted.
* FLOPs: 2 x active parameters x tokens (+ LM head per token) + attention (4 x heads x head_dim per
  attended entry, + indexer 2 x heads x dim per compressed entry). mHC / norms / sinkhorn are ignored.
* floor = max(bytes / bandwidth, FLOPs / matmul rate); ratio = measured / floor (1.0 = at the floor).
"""

from __future__ import annotations

import math
import os
import platform
import re
import statistics
import time
from dataclasses import dataclass, field

import torch

from deepinfer.checkpoint.reader import scale_name
from deepinfer.checkpoint.schema import FP4_BLOCK, expected_tensors
from deepinfer.config import ModelConfig
from deepinfer.model.transformer import Transformer
from deepinfer.model.weights import Linear
from deepinfer.ops import ops
from deepinfer.ops.reference import kv_packed_width
from deepinfer.tiny import _fp32_kept

WARMUP_STEPS = 2


@dataclass
class BenchOptions:
    """Everything `run_bench` needs; the CLI fills it from its options."""

    preset: str | None = None
    model: str | None = None
    batches: tuple = (1, 8, 32, 64)
    prompt_len: int = 128
    gen_len: int = 32
    backend: str | None = None
    strict: bool = False
    numerics: str = "official"
    dtype: str = "bfloat16"
    device: str | None = None
    seed: int = 0
    peer: str | None = None
    eager: bool = False
    progress: bool = True
    profile: bool = False
    notes: list = field(default_factory=list)


# --------------------------------------------------------------------------- device helpers


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.processor() or platform.machine()} ({os.cpu_count()} threads)"


def _timed(fn, device, iters: int) -> float:
    """Seconds per call of `fn`, after one warm-up call."""
    fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / iters


def measure_bandwidth(device: torch.device) -> float:
    """Copy bandwidth in bytes/s: (read + written) bytes / time of a large tensor copy on `device`."""
    nbytes = (2 << 30) if device.type == "cuda" else (256 << 20)
    a = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    b = torch.empty_like(a)
    s = _timed(lambda: b.copy_(a), device, 10 if device.type == "cuda" else 3)
    del a, b
    return 2 * nbytes / s


def measure_matmul(device: torch.device) -> tuple[float, str]:
    """(FLOP/s, what was measured): 8192^3 bf16 on GPU, 1024^3 fp32 on CPU."""
    n, dt = (8192, torch.bfloat16) if device.type == "cuda" else (1024, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dt)
    b = torch.randn(n, n, device=device, dtype=dt)
    s = _timed(lambda: a @ b, device, 10 if device.type == "cuda" else 3)
    return 2 * n**3 / s, f"{n}^3 {str(dt).removeprefix('torch.')} matmul"


def measure_fp8_matmul(device: torch.device) -> float | None:
    """FP8 e4m3 FLOP/s of an 8192^3 `torch._scaled_mm` (cuBLASLt, bf16 out): the ceiling the FP8/FP4
    GEMMs are held against. None off CUDA or where the GPU has no FP8 MMA (the error says which)."""
    if device.type != "cuda":
        return None
    n = 8192
    try:
        a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()  # column-major, as cuBLASLt wants
        one = torch.ones((), device=device)
        s = _timed(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16), device, 10)
    except (RuntimeError, TypeError):
        return None
    return 2 * n**3 / s


# --------------------------------------------------------------------------- model bytes and FLOPs

_LAYER = re.compile(r"layers\.(\d+)\.(.*)")
_EXPERT = re.compile(r"ffn\.experts\.(\d+)\.")


def _ckpt_bytes(name: str, spec) -> int:
    """Bytes of one tensor (+ its e8m0 scale) in the release's storage format."""
    n = math.prod(spec.shape)
    if spec.kind == "fp8":
        return n + math.prod(spec.scale_shape())
    if spec.kind == "fp4":
        return n // 2 + n // FP4_BLOCK
    if spec.kind == "int":
        return n * 4
    return n * (4 if _fp32_kept(name) else 2)


@dataclass
class ModelBytes:
    """Per main layer: dense bytes (all but routed experts and tid2eid) and bytes per routed expert,
    in checkpoint format (`ckpt_*`) and as the engine holds them (`eng_*`); LM head and embedding row
    bytes; and the logical parameter counts the FLOP floor needs."""

    ckpt_dense: list
    ckpt_expert: list
    eng_dense: list
    eng_expert: list
    ckpt_head: int
    eng_head: int
    ckpt_embed_row: int
    eng_embed_row: int
    dense_params: list  # per layer, 2-D weights except routed experts (all of them run per token)
    expert_params: int  # one routed expert (w1 + w2 + w3)
    head_params: int


def _walk(obj, seen: set, skip: set) -> int:
    """Bytes of every tensor reachable from an engine object (deepinfer classes, lists, dicts)."""
    if id(obj) in seen or id(obj) in skip or obj is None:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_walk(x, seen, skip) for x in obj)
    if isinstance(obj, dict):
        return sum(_walk(x, seen, skip) for x in obj.values())
    if not type(obj).__module__.startswith("deepinfer."):
        return 0
    if hasattr(obj, "__dict__"):
        vals = list(vars(obj).values())
    else:
        vals = [getattr(obj, s, None) for s in getattr(type(obj), "__slots__", ())]
    return sum(_walk(v, seen, skip) for v in vals)


def model_bytes(cfg: ModelConfig, model: Transformer) -> ModelBytes:
    """Count the bytes and parameters the floors need. Call before `allocate` (caches would count)."""
    L = cfg.n_layers
    ckpt_dense, ckpt_exp, dense_params = [0] * L, [0] * L, [0] * L
    expert_params = 0
    for name, spec in expected_tensors(cfg).items():
        m = _LAYER.fullmatch(name)
        if not m:
            continue
        i, rest = int(m[1]), m[2]
        if _EXPERT.match(rest):
            ckpt_exp[i] += _ckpt_bytes(name, spec)
            if i == 0:
                expert_params += math.prod(spec.shape)
        elif not rest.endswith("tid2eid"):
            ckpt_dense[i] += _ckpt_bytes(name, spec)
            if len(spec.shape) == 2 and not rest.startswith("hc_"):
                dense_params[i] += math.prod(spec.shape)
    E = cfg.n_routed_experts
    eng_dense, eng_exp = [], []
    for blk in model.layers:
        experts = blk.ffn.experts
        eng_exp.append(_walk(experts, set(), set()) / E)
        eng_dense.append(_walk(blk, set(), {id(experts), id(blk.ffn.tid2eid)}))
    head = model.head.weight
    return ModelBytes(
        ckpt_dense=ckpt_dense, ckpt_expert=[b / E for b in ckpt_exp], eng_dense=eng_dense, eng_expert=eng_exp,
        ckpt_head=cfg.vocab_size * cfg.dim * 2, eng_head=head.numel() * head.element_size(),
        ckpt_embed_row=cfg.dim * 2, eng_embed_row=cfg.dim * model.embed.element_size(),
        dense_params=dense_params, expert_params=expert_params // E, head_params=cfg.vocab_size * cfg.dim,
    )


def expected_distinct(E: int, k: int, tokens: int) -> float:
    """Expected distinct experts touched when `tokens` tokens each pick k of E uniformly."""
    return E * (1 - (1 - k / E) ** tokens)


def _entries(cfg: ModelConfig, layer: int, pos: int) -> tuple[int, int]:
    """(attention entries read, indexer keys scored) by the query at position `pos` in `layer`."""
    kind, r = cfg.attn_kinds[layer], cfg.compress_ratios[layer]
    win = min(pos + 1, cfg.window_size)
    n_c = (pos + 1) // r if r else 0
    if kind == "hca":
        return win + n_c, 0
    if kind == "csa":
        return win + min(cfg.index_topk, n_c), n_c
    return win, 0


def floors(cfg: ModelConfig, mb: ModelBytes, positions: list[int], bandwidth: float, flops_rate: float,
           cache_elem: int, head_tokens: int | None = None, kv_entry_bytes: int | None = None) -> dict:
    """Floors of one step in which the queries at `positions` run together (decode: B rows at their
    positions; prefill: 0..P-1). Returns bytes (ckpt / engine), FLOPs and the floor times in ms.
    kv_entry_bytes: bytes of one attention cache entry as the engine holds it (FP8 layout: 592 for V4;
    default head_dim x cache_elem); indexer keys are head_dim x cache_elem."""
    kv_entry = cfg.head_dim * cache_elem if kv_entry_bytes is None else kv_entry_bytes
    T = len(positions)
    head_tokens = T if head_tokens is None else head_tokens
    k, E = cfg.n_activated_experts, cfg.n_routed_experts
    distinct = expected_distinct(E, k, T)
    kv = flops = 0.0
    for i in range(cfg.n_layers):
        for p in positions:
            ent, idx = _entries(cfg, i, p)
            kv += ent * kv_entry + idx * cfg.index_head_dim * cache_elem
            flops += 4 * cfg.n_heads * cfg.head_dim * ent + 2 * cfg.index_n_heads * cfg.index_head_dim * idx
        flops += 2 * T * (mb.dense_params[i] + k * mb.expert_params)
    flops += 2 * head_tokens * mb.head_params
    out = {"tokens": T, "distinct_experts_per_layer": distinct, "kv_bytes": kv, "flops": flops}
    for tag, dense, exp, head, row in (("ckpt", mb.ckpt_dense, mb.ckpt_expert, mb.ckpt_head, mb.ckpt_embed_row),
                                       ("engine", mb.eng_dense, mb.eng_expert, mb.eng_head, mb.eng_embed_row)):
        w = sum(dense) + distinct * sum(exp) + head + T * row + T * k * cfg.n_hash_layers * 8  # tid2eid rows
        out[f"bytes_{tag}"] = w + kv
        out[f"t_bytes_{tag}_ms"] = (w + kv) / bandwidth * 1e3
    out["t_flops_ms"] = flops / flops_rate * 1e3
    out["floor_ms"] = max(out["t_bytes_ckpt_ms"], out["t_flops_ms"])
    out["floor_engine_ms"] = max(out["t_bytes_engine_ms"], out["t_flops_ms"])
    return out


# --------------------------------------------------------------------------- building the model


def build(opts: BenchOptions, device: torch.device, numerics) -> tuple[ModelConfig, Transformer, dict, str, float]:
    """(cfg, model, official-format state, source description, seconds to make the weights)."""
    t0 = time.perf_counter()
    if opts.model:
        from deepinfer.checkpoint import load_state, mtp_layers_present, open_checkpoint
        from deepinfer.config import load_config
        from deepinfer.engine.loader import resolve_model_dir

        model_dir = resolve_model_dir(opts.model, opts.progress)
        ckpt = open_checkpoint(model_dir)
        cfg = load_config(model_dir)
        if cfg.n_mtp_layers and mtp_layers_present(ckpt) == 0 and ckpt.layout == "transformers":
            cfg = cfg.replace(n_mtp_layers=0, attn_kinds=cfg.attn_kinds[:cfg.n_layers],
                              compress_ratios=cfg.compress_ratios[:cfg.n_layers])
        state = load_state(ckpt, cfg, device, progress=opts.progress)
        source = f"checkpoint {model_dir}"
    else:
        from deepinfer.engine.random_weights import random_state
        from deepinfer.presets import preset_config

        cfg = preset_config(opts.preset or "tiny")
        state = random_state(cfg, device, opts.seed)
        source = f"preset {opts.preset or 'tiny'} (random weights, seed {opts.seed})"
    sync(device)
    t_weights = time.perf_counter() - t0
    model = Transformer(cfg, state, numerics, device)
    return cfg, model, state, source, t_weights


# --------------------------------------------------------------------------- timing the engine


def _prompts(cfg: ModelConfig, rows: int, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, cfg.vocab_size, (rows, length), generator=g)


def time_prefill(model: Transformer, cfg: ModelConfig, P: int, device, seed: int, repeats: int = 3) -> dict:
    """TTFT of one P-token prompt (row 0): cold (first call) and warm median."""
    ids = _prompts(cfg, 1, P, seed).to(device)
    row = torch.zeros(1, dtype=torch.long, device=device)

    def once() -> float:
        sync(device)
        t = time.perf_counter()
        model.prefill(ids, rows=row)
        sync(device)
        return time.perf_counter() - t

    cold = once()
    warm = statistics.median(once() for _ in range(repeats))
    return {"prompt_len": P, "cold_ms": cold * 1e3, "ttft_ms": warm * 1e3, "tokens_per_s": P / warm}


def time_decode(model: Transformer, cfg: ModelConfig, B: int, P: int, K: int, device, seed: int,
                graphs: bool = False) -> dict:
    """Prefill B rows (P tokens each), then time K decode steps of the whole batch.

    graphs: replay the step as a captured CUDA graph (`DecodeRunner`); a capture failure is reported in
    the result (`graph_error`) and that row is timed eagerly instead -- never silently.
    """
    from deepinfer.engine.runner import DecodeRunner, GraphCaptureError

    max_len = P + WARMUP_STEPS + K + 1
    model.allocate(B + 1, max_len)  # +1: the runner's spare row for bucket padding
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    prompts = _prompts(cfg, B, P, seed + 1).to(device)
    rows = torch.arange(B, device=device)
    t = time.perf_counter()
    for i in range(B):  # the engine prefills per prompt
        model.prefill(prompts[i:i + 1], rows=rows[i:i + 1])
    sync(device)
    prefill_s = time.perf_counter() - t
    ids = _prompts(cfg, (WARMUP_STEPS + K) * B, 1, seed + 2).view(WARMUP_STEPS + K, B, 1).to(device)
    pos = torch.full((B,), P, dtype=torch.long, device=device)
    runner, graph_error, capture_s = DecodeRunner(model, B, graphs=graphs), None, None
    if runner.graphs:
        t = time.perf_counter()
        try:
            runner.capture()
            capture_s = time.perf_counter() - t
        except GraphCaptureError as e:
            graph_error = str(e)
            runner = DecodeRunner(model, B, graphs=False)
    for s in range(WARMUP_STEPS):
        runner.decode(ids[s], pos, rows)
        pos = pos + 1
    sync(device)
    t = time.perf_counter()
    for s in range(WARMUP_STEPS, WARMUP_STEPS + K):
        runner.decode(ids[s], pos, rows)
        pos = pos + 1
    sync(device)
    dt = (time.perf_counter() - t) / K
    out = {"batch": B, "ms_per_step": dt * 1e3, "tokens_per_s": B / dt, "prefill_rows_s": prefill_s,
           "mean_position": P + WARMUP_STEPS + (K - 1) / 2, "mode": runner.mode, "graph_error": graph_error,
           "capture_s": capture_s}
    if device.type == "cuda":
        out["peak_mem_bytes"] = torch.cuda.max_memory_allocated(device)
    return out


# --------------------------------------------------------------------------- the transformers peer

_ATTN = {"attn_sink": "sinks", "wq_a": "q_a_proj", "q_norm": "q_a_norm", "wq_b": "q_b_proj", "wkv": "kv_proj",
         "kv_norm": "kv_norm", "wo_a": "o_a_proj", "wo_b": "o_b_proj"}
_COMP = {"ape": "position_bias", "wkv": "kv_proj", "wgate": "gate_proj", "norm": "kv_norm"}
_SHARED = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_TOP = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight",
        "norm.weight": "model.norm.weight",
        "hc_head_fn": "model.hc_head.hc_fn", "hc_head_base": "model.hc_head.hc_base",
        "hc_head_scale": "model.hc_head.hc_scale"}


class PeerError(RuntimeError):
    """The transformers peer cannot be built or run; the message is the reason."""


def hf_name(name: str) -> str | None:
    """Official name -> transformers `DeepseekV4ForCausalLM` parameter name (None: MTP, routed experts,
    which transformers stacks into `experts.gate_up_proj` / `experts.down_proj`, and `.scale`s).

    The inverse of transformers' load-time renames for deepseek_v4 (conversion_mapping.py) and of
    `deepinfer.checkpoint.reader._from_transformers` (which only strips `model.` from the names
    `save_pretrained` writes back in the official spelling)."""
    if name in _TOP:
        return _TOP[name]
    m = _LAYER.fullmatch(name)
    if not m or name.endswith(".scale") or _EXPERT.match(m[2]):
        return None
    p, a = f"model.layers.{m[1]}.", m[2].split(".")
    if m[2] in ("attn_norm.weight", "ffn_norm.weight"):
        return p + ("input_layernorm" if a[0] == "attn_norm" else "post_attention_layernorm") + ".weight"
    if a[0].startswith("hc_"):  # hc_attn_fn -> attn_hc.fn
        _, which, what = a[0].split("_")
        return f"{p}{which}_hc.{what}"
    if a[0] == "attn":
        if a[1] == "compressor":
            return f"{p}self_attn.compressor.{_COMP[a[2]]}" + ("." + ".".join(a[3:]) if len(a) > 3 else "")
        if a[1] == "indexer":
            if a[2] == "compressor":
                return f"{p}self_attn.compressor.indexer.{_COMP[a[3]]}" + ("." + ".".join(a[4:]) if len(a) > 4 else "")
            sub = {"wq_b": "q_b_proj", "weights_proj": "scorer.weights_proj"}[a[2]]
            return f"{p}self_attn.compressor.indexer.{sub}." + ".".join(a[3:])
        return f"{p}self_attn.{_ATTN[a[1]]}" + ("." + ".".join(a[2:]) if len(a) > 2 else "")
    if a[0] == "ffn":
        if a[1] == "shared_experts":
            return f"{p}mlp.shared_experts.{_SHARED[a[2]]}.weight"
        if a[1] == "gate":
            return f"{p}mlp.gate." + {"bias": "e_score_correction_bias"}.get(a[2], a[2])
    raise PeerError(f"no transformers name for {name}")


def hf_config(cfg: ModelConfig):
    """A transformers DeepseekV4Config for the main layers of `cfg` (transformers has no MTP block)."""
    from transformers import DeepseekV4Config

    L = cfg.n_layers
    kinds, ratios = cfg.attn_kinds[:L], cfg.compress_ratios[:L]
    hca = {r for k, r in zip(kinds, ratios) if k == "hca"}
    csa = {r for k, r in zip(kinds, ratios) if k == "csa"}
    if len(hca) > 1 or csa - {4}:
        raise PeerError(f"transformers takes one ratio per attention kind; this config has CSA {csa}, HCA {hca}")
    names = {"swa": "sliding_attention", "csa": "compressed_sparse_attention", "hca": "heavily_compressed_attention"}
    rope = {"rope_type": "default"}
    if cfg.original_seq_len:
        rope = {"rope_type": "yarn", "factor": cfg.rope_factor, "beta_fast": cfg.beta_fast,
                "beta_slow": cfg.beta_slow, "original_max_position_embeddings": cfg.original_seq_len}
    return DeepseekV4Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, moe_intermediate_size=cfg.moe_inter_dim,
        num_hidden_layers=L, num_attention_heads=cfg.n_heads, head_dim=cfg.head_dim, q_lora_rank=cfg.q_lora_rank,
        qk_rope_head_dim=cfg.rope_head_dim, n_routed_experts=cfg.n_routed_experts,
        num_experts_per_tok=cfg.n_activated_experts,
        o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank, sliding_window=cfg.window_size,
        index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk,
        hc_mult=cfg.hc_mult, hc_sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps,
        layer_types=[names[k] for k in kinds], mlp_layer_types=["hash_moe" if h else "moe" for h in cfg.hash_layers],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": next(iter(hca), 128)},
        rope_theta=cfg.rope_theta, compress_rope_theta=cfg.compress_rope_theta, rope_parameters=rope,
        routed_scaling_factor=cfg.route_scale, swiglu_limit=cfg.swiglu_limit, scoring_func=cfg.score_func,
        rms_norm_eps=cfg.norm_eps, num_nextn_predict_layers=0, bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id,
    )


def _dequant(state: dict, name: str, dtype) -> torch.Tensor:
    """Official tensor `name` as a float tensor (exact: FP8/FP4 scales are powers of two)."""
    w = state[name]
    if w.dtype == torch.float8_e4m3fn:
        return Linear(w, state[scale_name(name)], "fp8").dequantized(dtype)
    if w.dtype in (torch.int8, torch.uint8) and scale_name(name) in state:
        return Linear(w.view(torch.int8), state[scale_name(name)], "fp4").dequantized(dtype)
    return w


def peer_bytes(cfg: ModelConfig) -> int:
    """bf16 bytes of the transformers model for `cfg` (main layers; fp32 parts counted as bf16)."""
    return sum(2 * math.prod(s.shape) for n, s in expected_tensors(cfg).items() if not n.startswith("mtp."))


@torch.no_grad()
def build_hf_peer(cfg: ModelConfig, state: dict, device: torch.device):
    """transformers' DeepseekV4ForCausalLM in bf16 (eager attention) holding the same weights as `state`.

    Built on the device with bf16 as the default dtype (the modules transformers keeps in fp32 create
    themselves in fp32, as under from_pretrained), then every parameter and persistent buffer is copied
    from the dequantised official tensors by name (`hf_name`); routed experts are stacked into
    `gate_up_proj` [E, 2I, D] (w1 then w3) and `down_proj` [E, D, I]. Any parameter left unfilled or any
    official tensor left unused is an error: a peer with random leftovers would time the wrong model."""
    from transformers import DeepseekV4ForCausalLM

    hcfg = hf_config(cfg)
    hcfg._attn_implementation = "eager"
    try:  # every parameter is overwritten below: skip transformers' random init (seconds at real sizes)
        from transformers.initialization import no_init_weights
    except ImportError:
        try:
            from transformers.modeling_utils import no_init_weights
        except ImportError:
            from contextlib import nullcontext as no_init_weights
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device), no_init_weights():
            hf = DeepseekV4ForCausalLM(hcfg)
    finally:
        torch.set_default_dtype(prev)
    hf.eval()
    targets = dict(hf.named_parameters())
    targets.update((n, b) for n, b in hf.named_buffers() if n.endswith(("tid2eid", "e_score_correction_bias")))
    filled, I = set(), cfg.moe_inter_dim
    for name in state:
        if name.startswith("mtp.") or name.endswith(".scale"):
            continue
        m = _LAYER.fullmatch(name)
        em = _EXPERT.match(m[2]) if m else None
        if em:
            e, w = int(em[1]), m[2].rsplit(".", 2)[-2]
            base = f"model.layers.{m[1]}.mlp.experts."
            dst = targets[base + ("down_proj" if w == "w2" else "gate_up_proj")]
            view = dst[e] if w == "w2" else (dst[e, :I] if w == "w1" else dst[e, I:])
            view.copy_(_dequant(state, name, dst.dtype))
            filled.add(base + ("down_proj" if w == "w2" else "gate_up_proj"))
            continue
        hn = hf_name(name)
        if hn not in targets:
            raise PeerError(f"official {name} maps to {hn}, which DeepseekV4ForCausalLM does not have")
        t, src = targets[hn], _dequant(state, name, targets[hn].dtype)
        if tuple(t.shape) != tuple(src.shape):
            raise PeerError(f"{name} {list(src.shape)} does not fit transformers' {hn} {list(t.shape)}")
        t.copy_(src)
        filled.add(hn)
    left = sorted(set(targets) - filled)
    if left:
        raise PeerError(f"{len(left)} transformers parameters have no official source: {left[:4]}")
    return hf


@torch.no_grad()
def time_hf_decode(hf, cfg: ModelConfig, B: int, P: int, K: int, device, seed: int) -> dict:
    """transformers: prefill B x P in one call, then K single-token steps with its own cache."""
    import inspect

    # transformers renamed `past_key_values` to `cache`; an unknown keyword would be swallowed by
    # **kwargs and every step would silently run without its cache
    key = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    ids = _prompts(cfg, B, P, seed + 1).to(device)
    steps = _prompts(cfg, (WARMUP_STEPS + K) * B, 1, seed + 2).view(WARMUP_STEPS + K, B, 1).to(device)
    out = hf(input_ids=ids, use_cache=True, logits_to_keep=1)
    cache = getattr(out, key, None)
    if cache is None:
        raise PeerError(f"transformers returned no `{key}` after the prefill")
    for s in range(WARMUP_STEPS):
        hf(input_ids=steps[s], use_cache=True, **{key: cache})
    sync(device)
    t = time.perf_counter()
    for s in range(WARMUP_STEPS, WARMUP_STEPS + K):
        hf(input_ids=steps[s], use_cache=True, **{key: cache})
    sync(device)
    dt = (time.perf_counter() - t) / K
    return {"batch": B, "ms_per_step": dt * 1e3, "tokens_per_s": B / dt}


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def run_peer(cfg: ModelConfig, state: dict, device, batches: list[int], P: int, K: int, seed: int,
             ours: dict) -> dict:
    """Time transformers at batch 1 and the largest batch; every failure becomes `{"error": ...}`."""
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the engine's freed caches would otherwise not count as free
    need, free = peer_bytes(cfg), _free_bytes(device)
    res = {"name": "transformers DeepseekV4ForCausalLM (bf16, eager)", "weight_bytes": need}
    try:
        import transformers

        res["version"] = transformers.__version__
    except ImportError as e:
        return {**res, "error": f"transformers is not importable ({e})"}
    if need > 0.9 * free:
        return {**res, "error": f"does not fit: needs {need / 2**30:.1f} GiB of bf16 weights, "
                                f"{free / 2**30:.1f} GiB free on {device}"}
    hf = None
    try:
        t = time.perf_counter()
        hf = build_hf_peer(cfg, state, device)
        sync(device)
        res["build_s"] = time.perf_counter() - t
        res["decode"] = []
        for B in sorted({min(batches), max(batches)}):
            r = time_hf_decode(hf, cfg, B, P, K, device, seed)
            if B in ours:
                r["speedup_ours"] = r["ms_per_step"] / ours[B]  # >1: DeepInfer is faster
            res["decode"].append(r)
    except Exception as e:  # OOM, an API change, a shape mismatch: report it, never hide it
        res["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    finally:
        del hf
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return res


# --------------------------------------------------------------------------- the whole run


def _versions() -> dict:
    try:
        import triton

        tv = triton.__version__
    except Exception:
        tv = None
    return {"torch": torch.__version__, "triton": tv}


def _fp8_prefill_gemm(device: torch.device) -> str | None:
    """What ran the prefill-sized FP8 GEMMs (`fp8_gemm`, M >= 65) of the Triton backend: "cublaslt" or
    "triton: <why not cuBLASLt>"; None for other backends."""
    if ops.backend != "triton":
        return None
    from deepinfer_kernels.triton import gemm_vendor

    return gemm_vendor.used_for(device)


def run_bench(opts: BenchOptions, log=lambda msg: None) -> dict:
    """Run every measurement of `deepinfer bench`; returns the JSON-able report."""
    from deepinfer.engine.loader import OptionError, resolve_device, resolve_numerics

    device = resolve_device(opts.device)
    numerics = resolve_numerics(opts.numerics, opts.dtype)
    batches = sorted(set(int(b) for b in opts.batches))
    if not batches or batches[0] < 1:
        raise OptionError(f"--batch {opts.batches}: batch sizes must be >= 1")
    if opts.prompt_len < 1 or opts.gen_len < 1:
        raise OptionError("--prompt-len and --gen-len must be >= 1")
    if opts.peer not in (None, "", "transformers"):
        raise OptionError(f"--peer {opts.peer!r}: only 'transformers' is supported")
    ops.configure(opts.backend or None, opts.strict if opts.strict else None)
    if ops.backend != "torch" and device.type != "cuda":
        from deepinfer.ops.registry import BackendError

        raise BackendError(f"--backend {ops.backend} needs a CUDA device (device is {device})")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    mem0 = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0

    # Graphs need CUDA and a backend whose decode step never syncs with the host (the torch reference
    # MoE does); --eager turns them off.
    graphs = device.type == "cuda" and not opts.eager and ops.backend != "torch"
    log(f"building the model on {device} ...")
    cfg, model, state, source, t_weights = build(opts, device, numerics)
    held = (torch.cuda.memory_allocated(device) - mem0) if device.type == "cuda" else None
    mb = model_bytes(cfg, model)
    log("measuring device bandwidth and matmul rate ...")
    bw = measure_bandwidth(device)
    rate, rate_what = measure_matmul(device)
    fp8_rate = measure_fp8_matmul(device)
    cache_elem = torch.empty((), dtype=numerics.dtype).element_size()
    kv_entry = kv_packed_width(cfg.head_dim, cfg.rope_head_dim, numerics.dtype) if model.attentions()[0].fp8_kv else None

    report = {
        "model": cfg.name, "source": source, "config_fingerprint": cfg.fingerprint(), "device": str(device),
        "device_name": device_name(device), **_versions(), "backend": ops.backend, "numerics": numerics.mode,
        "dtype": opts.dtype, "eager": not graphs, "cuda_graphs": graphs,
        "layers": cfg.n_layers, "attn_kinds": list(cfg.attn_kinds[:cfg.n_layers]),
        "weights_s": t_weights, "engine_weight_bytes": _walk(model, set(), set()),
        "device_bytes_after_build": held,
        "checkpoint_bytes_main": sum(mb.ckpt_dense) + sum(mb.ckpt_expert) * cfg.n_routed_experts + mb.ckpt_head,
        "bandwidth_Bps": bw, "matmul_flops": rate, "matmul_measured": rate_what, "matmul_fp8_flops": fp8_rate,
        "prompt_len": opts.prompt_len, "gen_len": opts.gen_len,
    }
    log(f"prefill: 1 x {opts.prompt_len} tokens ...")
    model.allocate(1, opts.prompt_len + 1)
    pf = time_prefill(model, cfg, opts.prompt_len, device, opts.seed)
    pf["floor"] = floors(cfg, mb, list(range(opts.prompt_len)), bw, rate, cache_elem, head_tokens=1,
                         kv_entry_bytes=kv_entry)
    pf["ratio"] = pf["ttft_ms"] / pf["floor"]["floor_ms"]
    report["prefill"] = pf

    report["decode"] = []
    # one untimed decode of the first batch size: first-call costs (allocator growth, thread pools, the
    # CPU reference's weight working copies, compiles) must not land in the first row's ms/step
    time_decode(model, cfg, batches[0], min(opts.prompt_len, 16), 2, device, opts.seed, graphs=False)
    for B in batches:
        log(f"decode: batch {B}, {opts.gen_len} steps ...")
        d = time_decode(model, cfg, B, opts.prompt_len, opts.gen_len, device, opts.seed, graphs=graphs)
        if d["graph_error"]:
            log(f"CUDA graph capture failed, timed eagerly: {d['graph_error']}")
        d["floor"] = floors(cfg, mb, [round(d["mean_position"])] * B, bw, rate, cache_elem,
                                kv_entry_bytes=kv_entry)
        d["ratio"] = d["ms_per_step"] / d["floor"]["floor_ms"]
        d["ratio_engine_bytes"] = d["ms_per_step"] / d["floor"]["floor_engine_ms"]
        report["decode"].append(d)
    if opts.profile:
        log(f"profiling one eager decode step at batch {batches[0]} ...")
        report["profile"] = profile_decode(model, cfg, batches[0], opts.prompt_len, device, opts.seed)
        if device.type == "cuda":
            from deepinfer.engine.oprates import profile_prefill

            log(f"timing the compute ops of one {opts.prompt_len}-token prefill ...")
            report["prefill_ops"] = profile_prefill(model, cfg, opts.prompt_len, device, opts.seed, fp8_rate, rate)
    report["fallbacks"] = sorted(ops.fallbacks)
    report["fp8_prefill_gemm"] = _fp8_prefill_gemm(device)
    if device.type == "cuda":
        report["peak_mem_bytes"] = max([d.get("peak_mem_bytes", 0) for d in report["decode"]]
                                       + [torch.cuda.max_memory_allocated(device)])
    if opts.peer == "transformers":
        log("transformers peer ...")
        model.allocate(1, 1)  # release the engine's big caches; the weights stay (same tensors as `state`)
        ours = {d["batch"]: d["ms_per_step"] for d in report["decode"]}
        report["peer"] = run_peer(cfg, state, device, batches, opts.prompt_len, opts.gen_len, opts.seed, ours)
    del model, state
    return report


def profile_decode(model: Transformer, cfg: ModelConfig, B: int, P: int, device, seed: int, steps: int = 3,
                   top: int = 40) -> list[dict]:
    """Where a decode step's time goes: torch.profiler over `steps` eager steps (graphs would hide the
    kernels), the `top` kernels by total device time -> [{name, calls, total_ms, share}] per step."""
    from torch.profiler import ProfilerActivity, profile

    model.allocate(B, P + steps + 4)
    prompts = _prompts(cfg, B, P, seed + 1).to(device)
    rows = torch.arange(B, device=device)
    for i in range(B):
        model.prefill(prompts[i:i + 1], rows=rows[i:i + 1])
    ids = _prompts(cfg, (steps + 1) * B, 1, seed + 2).view(steps + 1, B, 1).to(device)
    pos = torch.full((B,), P, dtype=torch.long, device=device)
    model.decode(ids[0], pos, rows)  # warm-up (compiles)
    sync(device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for s in range(1, steps + 1):
            model.decode(ids[s], pos + s, rows)
        sync(device)
    key = "device_time_total" if device.type == "cuda" else "cpu_time_total"
    evs = [e for e in prof.key_averages() if getattr(e, key, 0) > 0]
    if device.type == "cuda":  # kernels only (CPU-side ops also carry device time of their children)
        kernels = [e for e in evs if "CUDA" in str(getattr(e, "device_type", ""))]
        evs = kernels or evs
    total = sum(getattr(e, key) for e in evs) or 1.0
    evs.sort(key=lambda e: getattr(e, key), reverse=True)
    return [{"name": e.key[:90], "calls_per_step": e.count / steps, "ms_per_step": getattr(e, key) / 1e3 / steps,
             "share": getattr(e, key) / total} for e in evs[:top]]
