"""The floor model of `deepinfer bench`: the bytes and FLOPs one forward step must at least move, and the
time that takes at the device's measured rates (`deepinfer.bench.rates`). A floor is a lower bound on
the step time for this model and batch, never a measurement.

* bytes: what one step must read at least. Per main layer: its attention, shared expert, router, norms
  and mHC tensors; routed experts: E(1-(1-k/E)^T) distinct experts expected for T = B tokens x top-k over
  E experts (uniform routing), each at its size; the LM head; B embedding rows; the tid2eid rows of the
  hash layers (8 B per entry, int64 as the engine holds them); the KV / compressed entries each row reads
  (window + HCA entries, or CSA top-k + indexer keys). Counted twice:
  `ckpt` = tensors in their checkpoint formats (FP8 1 B per element + 1 B ue8m0 per 128x128 block, FP4
  0.5 B per element + 1 B ue8m0 per 32, bf16 floats, fp32 where the release stores fp32, LM head as bf16)
  = what an ideal kernel reads;
  `engine` = the bytes this engine actually holds for the same tensors (fp32 scales, fp32 LM head, bf16
  `wo_a`, fp32 compressor weights...). The MTP block is not run by decode and is not counted; neither are
  the final norm and `hc_head_*` (a few hundred KB at V4 sizes).
* FLOPs: 2 x active parameters x tokens (+ LM head per token) + attention (4 x heads x head_dim per
  attended entry, + indexer 2 x heads x dim per compressed entry). mHC / norms / sinkhorn are ignored.
* floor = max(bytes / bandwidth, FLOPs / matmul rate); ratio = measured / floor (1.0 = at the floor).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from deepinfer.checkpoint.schema import FP4_BLOCK, TensorSpec, expected_tensors
from deepinfer.config import ModelConfig
from deepinfer.checkpoint.schema import fp32_in_release

if TYPE_CHECKING:
    from deepinfer.model.transformer import Transformer

_LAYER = re.compile(r"layers\.(\d+)\.(.*)")
_EXPERT = re.compile(r"ffn\.experts\.(\d+)\.")
TID2EID_ENTRY_BYTES = 8  # int64, as the engine holds tid2eid (the release stores int32)


def ckpt_bytes(name: str, spec: TensorSpec) -> int:
    """Bytes of one tensor (+ its ue8m0 scale) in the release's storage format: FP8 1 B per element + 1 B
    per 128x128 block, FP4 0.5 B per element + 1 B per 32, int 4 B, floats 4 B where the release keeps
    fp32 (`fp32_in_release`) else 2 B (bf16)."""
    n = math.prod(spec.shape)
    if spec.kind == "fp8":
        return n + math.prod(spec.scale_shape())
    if spec.kind == "fp4":
        return n // 2 + n // FP4_BLOCK
    if spec.kind == "int":
        return n * 4
    return n * (4 if fp32_in_release(name) else 2)


@dataclass
class ModelBytes:
    """What the floors count, in bytes unless named `*_params` (logical elements).

    Per main layer (lists of length n_layers): dense bytes (all but routed experts and tid2eid) and bytes
    of one routed expert, in checkpoint format (`ckpt_*`) and as the engine holds them (`eng_*`; None when
    counted from the config alone); LM head and one embedding row; and the parameter counts the FLOP floor
    needs."""

    ckpt_dense: list
    ckpt_expert: list
    eng_dense: list | None
    eng_expert: list | None
    ckpt_head: int
    eng_head: int | None
    ckpt_embed_row: int
    eng_embed_row: int | None
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


def held_bytes(obj, skip: tuple = ()) -> int:
    """Bytes of every distinct tensor an engine object holds, not descending into the objects in `skip`."""
    return _walk(obj, set(), {id(x) for x in skip})


def model_bytes(cfg: ModelConfig, model: Transformer | None = None) -> ModelBytes:
    """Count the bytes and parameters the floors need. The `ckpt_*` counts and parameters come from the
    config alone; the `eng_*` counts walk `model` (None: left None). Call before `allocate` (caches would
    count)."""
    L = cfg.n_layers
    ckpt_dense, ckpt_exp, dense_params = [0] * L, [0] * L, [0] * L
    expert_params = 0
    for name, spec in expected_tensors(cfg).items():
        m = _LAYER.fullmatch(name)
        if not m:
            continue
        i, rest = int(m[1]), m[2]
        if _EXPERT.match(rest):
            ckpt_exp[i] += ckpt_bytes(name, spec)
            if i == 0:
                expert_params += math.prod(spec.shape)
        elif not rest.endswith("tid2eid"):
            ckpt_dense[i] += ckpt_bytes(name, spec)
            if len(spec.shape) == 2 and not rest.startswith("hc_"):
                dense_params[i] += math.prod(spec.shape)
    E = cfg.n_routed_experts
    eng_dense = eng_exp = eng_head = eng_row = None
    if model is not None:
        eng_dense, eng_exp = [], []
        for blk in model.layers:
            experts = blk.ffn.experts
            eng_exp.append(held_bytes(experts) / E)
            eng_dense.append(held_bytes(blk, skip=(experts, blk.ffn.tid2eid)))
        head = model.head.weight
        eng_head, eng_row = head.numel() * head.element_size(), cfg.dim * model.embed.element_size()
    return ModelBytes(
        ckpt_dense=ckpt_dense, ckpt_expert=[b / E for b in ckpt_exp], eng_dense=eng_dense, eng_expert=eng_exp,
        ckpt_head=cfg.vocab_size * cfg.dim * 2, eng_head=eng_head,
        ckpt_embed_row=cfg.dim * 2, eng_embed_row=eng_row,
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
    positions; prefill: 0..P-1).

    bandwidth: bytes/s; flops_rate: FLOP/s; cache_elem: bytes of one cache element (indexer keys are
    index_head_dim x cache_elem); kv_entry_bytes: bytes of one attention cache entry as the engine holds
    it (FP8 layout: 592 for V4; default head_dim x cache_elem); head_tokens: tokens the LM head runs on
    (default all of them).

    Returns tokens, distinct_experts_per_layer, kv_bytes, flops, bytes_{ckpt,engine} (weights + kv),
    t_bytes_{ckpt,engine}_ms, t_flops_ms, floor_ms (ckpt bytes) and floor_engine_ms; the engine keys only
    where `mb` has engine counts."""
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
    counts = [("ckpt", mb.ckpt_dense, mb.ckpt_expert, mb.ckpt_head, mb.ckpt_embed_row)]
    if mb.eng_dense is not None:
        counts.append(("engine", mb.eng_dense, mb.eng_expert, mb.eng_head, mb.eng_embed_row))
    for tag, dense, exp, head, row in counts:
        w = sum(dense) + distinct * sum(exp) + head + T * row + T * k * cfg.n_hash_layers * TID2EID_ENTRY_BYTES
        out[f"bytes_{tag}"] = w + kv
        out[f"t_bytes_{tag}_ms"] = (w + kv) / bandwidth * 1e3
    out["t_flops_ms"] = flops / flops_rate * 1e3
    out["floor_ms"] = max(out["t_bytes_ckpt_ms"], out["t_flops_ms"])
    if mb.eng_dense is not None:
        out["floor_engine_ms"] = max(out["t_bytes_engine_ms"], out["t_flops_ms"])
    return out
