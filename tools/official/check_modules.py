"""Issue 22's check: DeepSeek's official inference modules (model.py + kernel.py, release 60d8d707, TileLang
kernels) run on deepinfer-tiny, each on OUR inputs to it (dump taps), prefill then decode, layer by layer,
against our outputs, for the torch and the Triton backends of `--numerics official`.

Relative error ||ours - official|| / ||official|| (fp32) per layer: the attention sub-layer (attn.in ->
attn.out), the MoE (ffn.in -> ffn.out), the whole block (hc_attn.in -> hc_ffn.out). Plus the torch backend with
the previous sparse attention (fp32 P, max seeded with the sink) patched in, to show what that change moved, and
both backends with DEEPINFER_KV_QAT=1 (the FP8 KV QAT the release means, which its act_quant(inplace=True) skips).
Arguments pick configurations (`CONFIGS`); none runs them all.
"""
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.environ.get("OFFICIAL_DIR", os.path.join(HERE, "release")))  # model.py, kernel.py
sys.path.insert(1, HERE)  # the fast_hadamard_transform stand-in
torch.set_default_dtype(torch.bfloat16)
import model as om  # noqa: E402  (official)

from deepinfer.checkpoint.reader import open_checkpoint  # noqa: E402

from deepinfer.debug.dumper import run_dump  # noqa: E402
from deepinfer.engine.loader import load_model  # noqa: E402
from deepinfer.ops import ops, reference  # noqa: E402
from deepinfer.ops.registry import REGISTRY  # noqa: E402
from deepinfer.tiny import ensure_tiny_model  # noqa: E402

torch.set_default_dtype(torch.float32)
D = ensure_tiny_model()
C = json.load(open(os.path.join(D, "config.json")))
S, STEPS = 70, 6


def official_model():
    rs = C["rope_scaling"]
    args = om.ModelArgs(
        max_batch_size=1, max_seq_len=256, dtype="fp8", scale_fmt="ue8m0", expert_dtype="fp4",
        vocab_size=C["vocab_size"], dim=C["hidden_size"], moe_inter_dim=C["moe_intermediate_size"],
        n_layers=C["num_hidden_layers"], n_hash_layers=C["num_hash_layers"], n_mtp_layers=0,
        n_heads=C["num_attention_heads"], n_routed_experts=C["n_routed_experts"],
        n_shared_experts=C["n_shared_experts"], n_activated_experts=C["num_experts_per_tok"],
        score_func=C["scoring_func"], route_scale=C["routed_scaling_factor"], swiglu_limit=C["swiglu_limit"],
        q_lora_rank=C["q_lora_rank"], head_dim=C["head_dim"], rope_head_dim=C["qk_rope_head_dim"],
        norm_eps=C["rms_norm_eps"], o_groups=C["o_groups"], o_lora_rank=C["o_lora_rank"],
        window_size=C["sliding_window"], compress_ratios=tuple(C["compress_ratios"]),
        compress_rope_theta=C["compress_rope_theta"], original_seq_len=rs["original_max_position_embeddings"],
        rope_theta=C["rope_theta"], rope_factor=rs["factor"], beta_fast=int(rs["beta_fast"]),
        beta_slow=int(rs["beta_slow"]), index_n_heads=C["index_n_heads"], index_head_dim=C["index_head_dim"],
        index_topk=C["index_topk"], hc_mult=C["hc_mult"], hc_sinkhorn_iters=C["hc_sinkhorn_iters"],
        hc_eps=C["hc_eps"])
    with torch.device("cuda"):
        m = om.Transformer(args)
    ck = open_checkpoint(D)
    for name, p in m.named_parameters():
        t = ck.get(name, "cuda")
        if name.endswith("wo_a.weight"):  # convert.py: wo_a dequantised to bf16 (128 x 128 blocks)
            s = ck.get(name[:-6] + "scale", "cuda").float()
            t = (t.float().unflatten(0, (-1, 128)).unflatten(-1, (-1, 128)) * s[:, None, :, None]).flatten(2, 3)
            t = t.flatten(0, 1)
        if p.dtype == torch.float4_e2m1fn_x2:
            t = t.view(torch.float4_e2m1fn_x2)
        assert t.shape == p.shape, (name, t.shape, p.shape)
        p.data.copy_(t.to(p.dtype) if t.dtype != p.dtype else t)
    return m


def rel(a, b):
    a, b = a.float().cuda(), b.float().cuda()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def old_sparse_attn(q, kv, sink, idx, scale):
    """The sparse attention before this change: one softmax over all slots, the max seeded with the sink,
    P unrounded."""
    B, S_, H, Dh = q.shape
    valid = idx >= 0
    g = torch.gather(kv.float(), 1, idx.clamp_min(0).reshape(B, -1, 1).expand(-1, -1, Dh).long()).view(B, S_, -1, Dh)
    lg = torch.einsum("bshd,bskd->bshk", q.float(), g) * scale
    lg = lg.masked_fill(~valid.unsqueeze(2), float("-inf"))
    sl = sink.float().view(1, 1, H, 1).expand(B, S_, H, 1)
    m = torch.maximum(lg.amax(-1, keepdim=True), sl)
    p = torch.exp(lg - m)
    den = p.sum(-1, keepdim=True) + torch.exp(sl - m)
    return torch.einsum("bshk,bskd->bshd", p / den, g).to(q.dtype)


def ours(backend, old_attn=False, kv_qat=False):
    os.environ["DEEPINFER_KV_QAT"] = "1" if kv_qat else "0"  # read when the model is built
    real = reference.sparse_attn
    if old_attn:
        reference.sparse_attn = old_sparse_attn
        REGISTRY["sparse_attn"].impls["torch"] = old_sparse_attn
    try:
        ops.configure(backend=backend)
        lm = load_model(None, "official", "bfloat16", "cuda", progress=False)
        g = torch.Generator().manual_seed(22)
        ids = torch.randint(2, C["vocab_size"], (S,), generator=g).tolist()
        run = run_dump(lm.model, ids, steps=STEPS)
    finally:
        reference.sparse_attn = real
        REGISTRY["sparse_attn"].impls["torch"] = real
    return ids, run.tokens, dict(run.records)


def check(label, backend, old_attn=False, kv_qat=False):
    ids, toks, rec = ours(backend, old_attn, kv_qat)
    torch.set_default_dtype(torch.bfloat16)  # as generate.py: kernel.py allocates in the default dtype,
    torch.set_default_device("cuda")  # model.py's index helpers on the default device
    try:
        return _check(label, ids, toks, rec)
    finally:
        torch.set_default_dtype(torch.float32)
        torch.set_default_device("cpu")


@torch.inference_mode()
def _check(label, ids, toks, rec):
    ids_t = torch.tensor([ids], device="cuda")
    rows = []
    m_attn, m_blk, m_sens = official_model(), official_model(), official_model()
    gen = torch.Generator("cuda").manual_seed(7)
    for L in range(C["num_hidden_layers"]):
        r = {"layer": L}
        a = m_attn.layers[L]
        b = m_blk.layers[L]
        sb = m_sens.layers[L]
        _perturb_attention(sb, SENS_FRAC, gen)
        x = rec[f"layers.{L}.attn.in"][None].cuda()
        r["attn_prefill"] = rel(rec[f"layers.{L}.attn.out"][None], a.attn(x.clone(), 0))
        r["moe_prefill"] = rel(rec[f"layers.{L}.ffn.out"][None], a.ffn(rec[f"layers.{L}.ffn.in"][None].cuda(), ids_t))
        x_blk = rec[f"layers.{L}.hc_attn.in"][None].cuda()
        ob = b(x_blk.clone(), 0, ids_t)
        r["block_prefill"] = rel(rec[f"layers.{L}.hc_ffn.out"][None], ob)
        r["sens_prefill"] = rel(sb(x_blk.clone(), 0, ids_t), ob)
        da, db, dm, ds = [], [], [], []
        for k in range(1, STEPS + 1):
            p = f"step{k}.layers.{L}."
            tok = torch.tensor([[toks[k - 1]]], device="cuda")
            da.append(rel(rec[p + "attn.out"][None], a.attn(rec[p + "attn.in"][None].cuda(), S + k - 1)))
            dm.append(rel(rec[p + "ffn.out"][None], a.ffn(rec[p + "ffn.in"][None].cuda(), tok)))
            xk = rec[p + "hc_attn.in"][None].cuda()
            ob = b(xk.clone(), S + k - 1, tok)
            db.append(rel(rec[p + "hc_ffn.out"][None], ob))
            ds.append(rel(sb(xk.clone(), S + k - 1, tok), ob))
        r["attn_decode"], r["moe_decode"], r["block_decode"] = max(da), max(dm), max(db)
        r["block_decode_steps"], r["sens_decode_steps"], r["sens_decode"] = db, ds, max(ds)
        rows.append(r)
    print(f"\n== {label}: relative error against the official modules (decode: the worst of {STEPS} steps)")
    print(f"{'layer':>5} {'attn pre':>9} {'attn dec':>9} {'moe pre':>9} {'moe dec':>9} {'block pre':>9} {'block dec':>9}"
          f" {'self pre':>9} {'self dec':>9}")
    for r in rows:
        print(f"{r['layer']:>5} " + " ".join(f"{100 * r[k]:8.3f}%" for k in
              ("attn_prefill", "attn_decode", "moe_prefill", "moe_decode", "block_prefill", "block_decode",
               "sens_prefill", "sens_decode")))
    print(f"self: the official block against itself with {100 * SENS_FRAC:.1f} % of its attention output moved by one "
          "bf16 ulp: what an fp32-order difference in the attention core does to one block")
    for r in rows:
        print(f"  layer {r['layer']} block dec per step: " + " ".join(f"{100 * v:.3f}%" for v in r["block_decode_steps"])
              + "   self: " + " ".join(f"{100 * v:.3f}%" for v in r["sens_decode_steps"]))
    return rows


SENS_FRAC = float(os.environ.get("SENS_FRAC", "0.008"))  # check_kernels: 99.2 % of sparse_attn outputs equal


def _perturb_attention(block, frac, gen):
    """Make `block.attn` return its output with a random `frac` of its bf16 elements moved by one ulp (random
    direction): what two attention cores summing in different fp32 orders leave in a bf16 output."""
    inner = block.attn.forward

    def forward(x, start_pos):
        o = inner(x, start_pos)
        assert o.dtype == torch.bfloat16
        pick = torch.rand(o.shape, device=o.device, generator=gen) < frac
        step = torch.randint(0, 2, o.shape, device=o.device, generator=gen, dtype=torch.int16) * 2 - 1
        bits = o.contiguous().view(torch.int16)
        return torch.where(pick & (o != 0), bits + step, bits).view(torch.bfloat16)

    block.attn.forward = forward


CONFIGS = {  # key: (label, backend, old_attn, kv_qat)
    "torch": ("torch backend", "torch", False, False),
    "triton": ("triton backend", "triton", False, False),
    "tilelang": ("tilelang backend", "tilelang", False, False),
    "torch_old_attn": ("torch backend, the previous sparse attention", "torch", True, False),
    # the KV cache's FP8 QAT the release means to apply (its act_quant(inplace=True) leaves the values in bf16)
    "torch_kv_qat1": ("torch backend, DEEPINFER_KV_QAT=1", "torch", False, True),
    "triton_kv_qat1": ("triton backend, DEEPINFER_KV_QAT=1", "triton", False, True),
}

if __name__ == "__main__":
    keys = sys.argv[1:] or list(CONFIGS)
    bad = [k for k in keys if k not in CONFIGS]
    if bad:
        sys.exit(f"unknown config {bad}; choose from {', '.join(CONFIGS)}")
    out = {}
    for k in keys:
        label, backend, old_attn, kv_qat = CONFIGS[k]
        env = os.environ.get("DEEPINFER_FP8_GEMM")
        out[k] = check(label + (f", DEEPINFER_FP8_GEMM={env}" if env else ""), backend, old_attn=old_attn, kv_qat=kv_qat)
    path = os.path.join(os.environ.get("OUT", "/tmp"), "official22.json")
    json.dump(out, open(path, "w"), indent=1)
