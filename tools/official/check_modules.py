"""The module-by-module check behind `deepinfer verify --against official` (`deepinfer/debug/official.py`), with the
extra columns that command leaves out: the official block's own sensitivity ("self": its attention output moved by
one bf16 ulp in SENS_FRAC of its elements), the previous sparse attention patched into ours, and our KV form
switched against the release's (kv_qat). Runs DeepSeek's model.py + kernel.py from OFFICIAL_DIR (default
tools/official/release/60d8d707) on deepinfer-tiny, each module on OUR inputs to it (dump taps), prefill then
decode, layer by layer. Arguments pick configurations (`CONFIGS`); none runs them all.
"""
import json
import os
import sys

import torch

from deepinfer.debug import official as off

HERE = os.path.dirname(os.path.abspath(__file__))
OFFICIAL_DIR = os.environ.get("OFFICIAL_DIR", os.path.join(HERE, "release", "60d8d707"))
RELEASE, _ = off.identify(OFFICIAL_DIR)
HADAMARD = off.hadamard_source()
torch.set_default_dtype(torch.bfloat16)
om = off.load_official(OFFICIAL_DIR)  # noqa: E402  (official)

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
    return off.official_model(om, D, 256)


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


def ours(backend, old_attn=False, kv_qat=None):
    """kv_qat None: the release's KV form; True / False: the FP8-rounded or the bf16 cache whatever the release."""
    real = reference.sparse_attn
    if old_attn:
        reference.sparse_attn = old_sparse_attn
        REGISTRY["sparse_attn"].impls["torch"] = old_sparse_attn
    try:
        ops.configure(backend=backend)
        lm = load_model(None, f"official@{RELEASE.short}", "bfloat16", "cuda", progress=False,
                        kv=None if kv_qat is None else ("fp8" if kv_qat else "bf16"))
        g = torch.Generator().manual_seed(22)
        ids = torch.randint(2, C["vocab_size"], (S,), generator=g).tolist()
        run = run_dump(lm.model, ids, steps=STEPS)
    finally:
        reference.sparse_attn = real
        REGISTRY["sparse_attn"].impls["torch"] = real
    return ids, run.tokens, dict(run.records)


def check(label, backend, old_attn=False, kv_qat=None):
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
    print(f"\n== {label} (Hadamard: {HADAMARD}): relative error against the official modules (decode: the worst of {STEPS} steps)")
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


CONFIGS = {  # key: (label, backend, old_attn, kv_qat: None = the release's form)
    "torch": ("torch backend", "torch", False, None),
    "triton": ("triton backend", "triton", False, None),
    "tilelang": ("tilelang backend", "tilelang", False, None),
    "torch_old_attn": ("torch backend, the previous sparse attention", "torch", True, None),
    # our KV form against the release's: what the act_quant(inplace=True) hunk between the releases moves
    "torch_kv_bf16": ("torch backend, kv=bf16 (efc85512's form)", "torch", False, False),
    "torch_kv_fp8": ("torch backend, kv=fp8 (60d8d707's form)", "torch", False, True),
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
        out[k] = check(f"release {RELEASE.short}, " + label + (f", DEEPINFER_FP8_GEMM={env}" if env else ""), backend,
                       old_attn=old_attn, kv_qat=kv_qat)
    path = os.path.join(os.environ.get("OUT", "/tmp"), "official22.json")
    json.dump(out, open(path, "w"), indent=1)
