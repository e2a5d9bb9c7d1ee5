"""The tensors a V4 checkpoint must hold, by official name, with shape and storage kind.

Storage kinds:

* ``fp8``   FP8 e4m3 ``[N, K]`` plus ``<name>.scale``: ue8m0 per 128x128 block ``[ceil(N/128), ceil(K/128)]``
* ``fp4``   e2m1 packed two per byte (low nibble first) as int8 ``[N, K/2]`` plus ``<name>.scale``: ue8m0 per 32
            inputs ``[N, K/32]``
* ``float`` a floating-point tensor stored as is (bf16 in the release; fp32 or fp16 accepted)
* ``int``   an integer table (``tid2eid``: int32 in the release, int64 from transformers)

`dense` linears follow ``cfg.weight_dtype``; routed experts follow ``cfg.expert_dtype``. A weight whose
kind is ``float`` in the config's own format may not be quantised and vice versa: the validator reports
it as mis-typed.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.config import ModelConfig

FP8_BLOCK = 128
FP4_BLOCK = 32


@dataclass(frozen=True)
class TensorSpec:
    """One expected checkpoint entry: logical shape [N, K] for linears (storage shape derives from kind)."""

    shape: tuple
    kind: str  # "fp8" | "fp4" | "float" | "int"

    def storage_shape(self) -> tuple:
        if self.kind == "fp4":
            n, k = self.shape
            return (n, k // 2)
        return self.shape

    def scale_shape(self) -> tuple | None:
        if self.kind == "fp8":
            n, k = self.shape
            return (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK))
        if self.kind == "fp4":
            n, k = self.shape
            return (n, k // FP4_BLOCK)
        return None


def _fmt(dtype: str) -> str:
    return {"fp8": "fp8", "fp4": "fp4"}.get(dtype, "float")


def _block(cfg: ModelConfig, p: str, layer_id: int, out: dict, mtp: bool = False) -> None:
    """Entries of one transformer block (attention + MoE + mHC) under prefix `p`."""
    dense, expert = _fmt(cfg.weight_dtype), _fmt(cfg.expert_dtype)
    d, hd, ihd = cfg.dim, cfg.head_dim, cfg.index_head_dim
    hc = cfg.hc_mult
    mix = (2 + hc) * hc
    kind, ratio = cfg.attn_kinds[layer_id], cfg.compress_ratios[layer_id]

    a = p + "attn."
    out[a + "attn_sink"] = TensorSpec((cfg.n_heads,), "float")
    out[a + "wq_a.weight"] = TensorSpec((cfg.q_lora_rank, d), dense)
    out[a + "q_norm.weight"] = TensorSpec((cfg.q_lora_rank,), "float")
    out[a + "wq_b.weight"] = TensorSpec((cfg.n_heads * hd, cfg.q_lora_rank), dense)
    out[a + "wkv.weight"] = TensorSpec((hd, d), dense)
    out[a + "kv_norm.weight"] = TensorSpec((hd,), "float")
    out[a + "wo_a.weight"] = TensorSpec((cfg.o_groups * cfg.o_lora_rank, cfg.n_heads * hd // cfg.o_groups), dense)
    out[a + "wo_b.weight"] = TensorSpec((d, cfg.o_groups * cfg.o_lora_rank), dense)
    if kind != "swa":
        coff = 2 if kind == "csa" else 1  # CSA pools overlapping windows: two series per token
        c = a + "compressor."
        out[c + "ape"] = TensorSpec((ratio, coff * hd), "float")
        out[c + "wkv.weight"] = TensorSpec((coff * hd, d), "float")
        out[c + "wgate.weight"] = TensorSpec((coff * hd, d), "float")
        out[c + "norm.weight"] = TensorSpec((hd,), "float")
    if kind == "csa":
        i = a + "indexer."
        out[i + "wq_b.weight"] = TensorSpec((cfg.index_n_heads * ihd, cfg.q_lora_rank), dense)
        out[i + "weights_proj.weight"] = TensorSpec((cfg.index_n_heads, d), "float")
        c = i + "compressor."
        out[c + "ape"] = TensorSpec((ratio, 2 * ihd), "float")
        out[c + "wkv.weight"] = TensorSpec((2 * ihd, d), "float")
        out[c + "wgate.weight"] = TensorSpec((2 * ihd, d), "float")
        out[c + "norm.weight"] = TensorSpec((ihd,), "float")

    f = p + "ffn."
    out[f + "gate.weight"] = TensorSpec((cfg.n_routed_experts, d), "float")
    # The MTP block routes by top-k (it is past the hash layers).
    if not mtp and cfg.hash_layers[layer_id]:
        out[f + "gate.tid2eid"] = TensorSpec((cfg.vocab_size, cfg.n_activated_experts), "int")
    else:
        out[f + "gate.bias"] = TensorSpec((cfg.n_routed_experts,), "float")
    inter = cfg.moe_inter_dim
    for e in range(cfg.n_routed_experts):
        x = f"{f}experts.{e}."
        out[x + "w1.weight"] = TensorSpec((inter, d), expert)
        out[x + "w2.weight"] = TensorSpec((d, inter), expert)
        out[x + "w3.weight"] = TensorSpec((inter, d), expert)
    s = f + "shared_experts."
    out[s + "w1.weight"] = TensorSpec((inter, d), dense)
    out[s + "w2.weight"] = TensorSpec((d, inter), dense)
    out[s + "w3.weight"] = TensorSpec((inter, d), dense)

    out[p + "attn_norm.weight"] = TensorSpec((d,), "float")
    out[p + "ffn_norm.weight"] = TensorSpec((d,), "float")
    for which in ("attn", "ffn"):
        out[f"{p}hc_{which}_fn"] = TensorSpec((mix, hc * d), "float")
        out[f"{p}hc_{which}_base"] = TensorSpec((mix,), "float")
        out[f"{p}hc_{which}_scale"] = TensorSpec((3,), "float")


def expected_tensors(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Every tensor of the official layout for `cfg`, in forward order (embed, layers, head, MTP)."""
    out: dict[str, TensorSpec] = {}
    d, hc = cfg.dim, cfg.hc_mult
    out["embed.weight"] = TensorSpec((cfg.vocab_size, d), "float")
    for i in range(cfg.n_layers):
        _block(cfg, f"layers.{i}.", i, out)
    out["norm.weight"] = TensorSpec((d,), "float")
    out["hc_head_fn"] = TensorSpec((hc, hc * d), "float")
    out["hc_head_base"] = TensorSpec((hc,), "float")
    out["hc_head_scale"] = TensorSpec((1,), "float")
    out["head.weight"] = TensorSpec((cfg.vocab_size, d), "float")
    dense = _fmt(cfg.weight_dtype)
    for m in range(cfg.n_mtp_layers):
        p = f"mtp.{m}."
        _block(cfg, p, cfg.n_layers + m, out, mtp=True)
        out[p + "e_proj.weight"] = TensorSpec((d, d), dense)
        out[p + "h_proj.weight"] = TensorSpec((d, d), dense)
        out[p + "enorm.weight"] = TensorSpec((d,), "float")
        out[p + "hnorm.weight"] = TensorSpec((d,), "float")
        out[p + "norm.weight"] = TensorSpec((d,), "float")
        out[p + "hc_head_fn"] = TensorSpec((hc, hc * d), "float")
        out[p + "hc_head_base"] = TensorSpec((hc,), "float")
        out[p + "hc_head_scale"] = TensorSpec((1,), "float")
    return out


def fp32_in_release(name: str) -> bool:
    """Float tensors the release stores in fp32 (attention sinks, compressor `ape`, the mHC parameters, the
    router's bias); every other float tensor is bf16."""
    last = name.rsplit(".", 1)[-1]
    return name.endswith(".ape") or last == "attn_sink" or last.startswith("hc_") or name.endswith("gate.bias")


def checkpoint_bytes(cfg: ModelConfig) -> int:
    """Bytes the official layout occupies (weights + scales), bf16 for floats: the device-fit estimate."""
    total = 0
    for spec in expected_tensors(cfg).values():
        n = 1
        for s in spec.storage_shape():
            n *= s
        total += n * {"fp8": 1, "fp4": 1, "float": 2, "int": 4}[spec.kind]
        ss = spec.scale_shape()
        if ss:
            total += ss[0] * ss[1]
    return total
