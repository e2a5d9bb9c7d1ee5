"""`deepinfer verify --against official`: DeepSeek's own inference code (`inference/model.py` and its TileLang
`kernel.py`) run module by module on our inputs to each module, against our `official` numerics of the same release.

The files are identified by their sha256 before anything runs (`identify`): a known release's pair decides the
numerics ours run in (`official@60d8d707` or `official@efc85512`); an edited copy, a mixed pair or another model's
code (V4.1) is refused in one line. Then, on CUDA with TileLang (kernel.py's kernels are TileLang):

* ours: a dump of the prompt and `steps` greedy decode steps (`run_dump`: every tap);
* theirs: the official `Transformer` built from the same checkpoint (wo_a dequantised as convert.py does), each
  module fed the input our dump recorded for it -- the attention sub-layer (`attn.in`, with its compressor and
  indexer, which fill the official caches as the module runs), the MoE with its gate (`ffn.in`), the whole block
  (`hc_attn.in`) and the head (the last block's `hc_ffn.out`), at prefill and at each decode step in order;
* per layer the relative error ||ours - theirs|| / ||theirs|| (fp32) of: the attention output, the window kv and,
  after prefill, the compressed entries and the indexer keys in the official caches, the MoE output, the block's
  streams; and the logits. A cell over its limit (`LIMITS`) fails the verdict.

Limits: attention, kv, entries, keys, MoE and logits 0.5 %, the block 1 % -- the official block moves by up to
0.7 % at prefill (more at single decode tokens) when 0.8 % of its own attention outputs move by one bf16 ulp, what a
different fp32 summation order in the attention core leaves (tools/official/README.md).

`fast_hadamard_transform` (model.py's `rotate_activation`) is used where installed; else the unnormalised
Sylvester Walsh-Hadamard transform in fp32 (what its CUDA kernel computes) stands in, and the verdict says which.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
import types
from dataclasses import dataclass, field

import torch

from deepinfer.model.numerics import OFFICIAL_RELEASES, RELEASE_QUIRKS, Release

LIMITS = {"attn": 0.005, "kv": 0.005, "entries": 0.005, "index_keys": 0.005, "moe": 0.005, "block": 0.01,
          "logits": 0.005}
FILES = ("model.py", "kernel.py")


# ------------------------------------------------------------------------------------ which release
def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def known_releases(fname: str) -> str:
    """The releases whose `fname` we know, with its digest's first 16 hex digits: for refusal lines."""
    attr = "model_sha256" if fname == "model.py" else "kernel_sha256"
    return ", ".join(f"{r.short} ({r.label}) {getattr(r, attr)[:16]}..." for r in OFFICIAL_RELEASES.values())


def identify(official_dir: str) -> tuple[Release, dict[str, str]]:
    """The release of DeepSeek's inference code in `official_dir` (its model.py and kernel.py, by sha256) ->
    (release, {file: digest}); ValueError in one line naming the file, its digest and the releases known."""
    if not os.path.isdir(official_dir):
        raise ValueError(f"--official-dir {official_dir}: no such directory")
    digests, found = {}, {}
    for fname in FILES:
        path = os.path.join(official_dir, fname)
        if not os.path.isfile(path):
            raise ValueError(f"--official-dir {official_dir}: no {fname} (DeepSeek-V4's inference/{fname})")
        digests[fname] = d = sha256(path)
        attr = "model_sha256" if fname == "model.py" else "kernel_sha256"
        hit = [r for r in OFFICIAL_RELEASES.values() if getattr(r, attr) == d]
        if not hit:
            raise ValueError(f"{path}: sha256 {d} is no known release of DeepSeek-V4's inference code (an edited "
                             f"copy or another model's); known {fname}: {known_releases(fname)}")
        found[fname] = hit[0]
    if found["model.py"] is not found["kernel.py"]:
        raise ValueError(f"--official-dir {official_dir}: model.py is release {found['model.py'].short}, kernel.py "
                         f"release {found['kernel.py'].short}; one release's pair is needed")
    return found["model.py"], digests


def quirks(release: str) -> tuple[str, ...]:
    """What the release computes differently from the other one, a line each (`RELEASE_QUIRKS`)."""
    return RELEASE_QUIRKS[release]


# ------------------------------------------------------------------------------------ loading their code
def sylvester_hadamard(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """fast_hadamard_transform.hadamard_transform's contract: the unnormalised Sylvester Walsh-Hadamard transform
    of the last dim (a power of two) in fp32, times `scale`, in x's dtype."""
    n = x.size(-1)
    h = torch.ones(1, 1, dtype=torch.float32, device=x.device)
    while h.size(0) < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return ((x.float() @ h) * scale).to(x.dtype)


def hadamard_source() -> str:
    """Install what model.py's `from fast_hadamard_transform import hadamard_transform` gets; say which."""
    try:
        import fast_hadamard_transform

        if getattr(fast_hadamard_transform, "hadamard_transform", None) is sylvester_hadamard:
            raise ImportError("ours, from an earlier call")
        from importlib.metadata import PackageNotFoundError, version
        try:
            v = version("fast_hadamard_transform")
        except PackageNotFoundError:
            v = "?"
        return f"fast_hadamard_transform {v}"
    except ImportError:
        stand_in = types.ModuleType("fast_hadamard_transform")
        stand_in.hadamard_transform = sylvester_hadamard
        sys.modules["fast_hadamard_transform"] = stand_in
        return "the fp32 Sylvester transform (fast_hadamard_transform is not installed)"


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def load_official(official_dir: str, kernel=None):
    """Import the release's kernel.py (as `kernel`, the name model.py imports it by) and model.py. kernel: a module
    to stand in for kernel.py (the tests' plain-PyTorch one, to run model.py's own code on a CPU)."""
    if kernel is None:
        _load("kernel", os.path.join(official_dir, "kernel.py"))
    else:
        sys.modules["kernel"] = kernel
    return _load("deepseek_v4_official_model", os.path.join(official_dir, "model.py"))


def official_args(om, cfg: dict, max_seq_len: int):
    """model.py's ModelArgs from a checkpoint's config.json (Hugging Face keys), no MTP, batch 1."""
    rs = cfg.get("rope_scaling") or {}
    return om.ModelArgs(
        max_batch_size=1, max_seq_len=max_seq_len, dtype="fp8", scale_fmt="ue8m0", expert_dtype="fp4",
        vocab_size=cfg["vocab_size"], dim=cfg["hidden_size"], moe_inter_dim=cfg["moe_intermediate_size"],
        n_layers=cfg["num_hidden_layers"], n_hash_layers=cfg["num_hash_layers"], n_mtp_layers=0,
        n_heads=cfg["num_attention_heads"], n_routed_experts=cfg["n_routed_experts"],
        n_shared_experts=cfg["n_shared_experts"], n_activated_experts=cfg["num_experts_per_tok"],
        score_func=cfg["scoring_func"], route_scale=cfg["routed_scaling_factor"], swiglu_limit=cfg["swiglu_limit"],
        q_lora_rank=cfg["q_lora_rank"], head_dim=cfg["head_dim"], rope_head_dim=cfg["qk_rope_head_dim"],
        norm_eps=cfg["rms_norm_eps"], o_groups=cfg["o_groups"], o_lora_rank=cfg["o_lora_rank"],
        window_size=cfg["sliding_window"], compress_ratios=tuple(cfg["compress_ratios"][:cfg["num_hidden_layers"]]),
        compress_rope_theta=cfg["compress_rope_theta"], original_seq_len=rs.get("original_max_position_embeddings", 0),
        rope_theta=cfg["rope_theta"], rope_factor=rs.get("factor", 1.0), beta_fast=int(rs.get("beta_fast", 32)),
        beta_slow=int(rs.get("beta_slow", 1)), index_n_heads=cfg["index_n_heads"], index_head_dim=cfg["index_head_dim"],
        index_topk=cfg["index_topk"], hc_mult=cfg["hc_mult"], hc_sinkhorn_iters=cfg["hc_sinkhorn_iters"],
        hc_eps=cfg["hc_eps"])


def official_model(om, model_dir: str, max_seq_len: int, device: str = "cuda"):
    """The official Transformer on `device` with the checkpoint's tensors (official layout), wo_a dequantised to
    bf16 per 128 x 128 block as convert.py does."""
    from deepinfer.checkpoint.reader import open_checkpoint

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    with torch.device(device):
        m = om.Transformer(official_args(om, cfg, max_seq_len))
    ck = open_checkpoint(model_dir)
    if ck.layout != "official":
        raise ValueError(f"--model {model_dir}: verify --against official reads an official-layout checkpoint "
                         f"(this one is {ck.layout})")
    for name, p in m.named_parameters():
        t = ck.get(name, device)
        if name.endswith("wo_a.weight"):
            s = ck.get(name[:-6] + "scale", device).float()
            t = (t.float().unflatten(0, (-1, 128)).unflatten(-1, (-1, 128)) * s[:, None, :, None]).flatten(2, 3)
            t = t.flatten(0, 1)
        if p.dtype == torch.float4_e2m1fn_x2:
            t = t.view(torch.float4_e2m1fn_x2)
        if t.shape != p.shape:
            raise ValueError(f"--model {model_dir}: {name} is {tuple(t.shape)} in the checkpoint, the official "
                             f"module holds {tuple(p.shape)}")
        p.data.copy_(t.to(p.dtype) if t.dtype != p.dtype else t)
    return m


# ------------------------------------------------------------------------------------ the comparison
def rel(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """||ours - theirs|| / ||theirs|| in fp32 on theirs' device; NaN anywhere gives inf (never a pass)."""
    b = theirs.float()
    a = ours.float().to(b.device)
    if a.shape != b.shape:
        a = a.reshape(b.shape)
    err = float((a - b).norm() / b.norm().clamp_min(1e-30))
    return err if err == err else float("inf")  # NaN never passes


@dataclass
class OfficialResult:
    release: str
    digests: dict
    backend: str
    model: str
    prompt_tokens: int
    steps: int
    hadamard: str
    rows: list = field(default_factory=list)  # per layer: {"layer", "kind", "<what>_<phase>": rel err}
    logits: dict = field(default_factory=dict)  # {"prefill": err, "decode": worst}
    failures: list = field(default_factory=list)  # "layer 2 attn decode 0.61 % > 0.5 %"
    worst: dict = field(default_factory=dict)  # what -> [err, where]

    @property
    def passed(self) -> bool:
        return not self.failures

    def line(self) -> str:
        what = ", ".join(f"{k} {100 * v[0]:.3f} % ({v[1]})" for k, v in self.worst.items())
        verdict = "PASS" if self.passed else f"FAIL ({len(self.failures)} cells over their limits: " + \
            "; ".join(self.failures[:4]) + (" ..." if len(self.failures) > 4 else "") + ")"
        return (f"{verdict}: official@{self.release} ({self.model}, {self.backend} backend, {self.prompt_tokens}-token "
                f"prompt + {self.steps} decode steps; Hadamard: {self.hadamard}) worst: {what}")

    def to_dict(self) -> dict:
        return {**self.__dict__, "passed": self.passed, "limits": LIMITS}


def compare_modules(om, model_dir: str, cfg, ids: list[int], tokens: list[int], rec: dict, steps: int,
                    device: str = "cuda") -> tuple:
    """Each official module on our recorded inputs -> (rows, logits errors). Runs with model.py's defaults:
    bf16 tensors on the device (kernel.py allocates in the default dtype, model.py's index helpers on the
    default device)."""
    S = len(ids)
    max_seq_len = max(256, -(-(S + steps + 1) // 128) * 128)
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device(device)
    try:
        with torch.inference_mode():
            return _compare(om, model_dir, cfg, ids, tokens, rec, steps, max_seq_len, device)
    finally:
        torch.set_default_dtype(torch.float32)
        torch.set_default_device("cpu")


def _compare(om, model_dir, cfg, ids, tokens, rec, steps, max_seq_len, dev):
    S = len(ids)
    ids_t = torch.tensor([ids], device=dev)
    m_mod, m_blk = (official_model(om, model_dir, max_seq_len, dev) for _ in range(2))
    rows = []
    for L in range(cfg.n_layers):
        a, b = m_mod.layers[L], m_blk.layers[L]
        kind, ratio, win = cfg.attn_kinds[L], cfg.compress_ratios[L], cfg.window_size
        p = f"layers.{L}."
        r = {"layer": L, "kind": kind}
        r["attn_prefill"] = rel(rec[p + "attn.out"][None], a.attn(rec[p + "attn.in"][None].to(dev).clone(), 0))
        pos = torch.arange(max(0, S - win), S)  # the window's slots after prefill: position p at p % win
        r["kv_prefill"] = rel(rec[p + "attn.kv"][pos][None], a.attn.kv_cache[:1, pos % win])
        if ratio:
            n = S // ratio
            if n:
                r["entries_prefill"] = rel(rec[p + "attn.compressed_kv"][None], a.attn.kv_cache[:1, win:win + n])
                if kind == "csa":
                    r["index_keys_prefill"] = rel(rec[p + "attn.indexer.kv"][:n][None],
                                                  a.attn.indexer.kv_cache[:1, :n])
        r["moe_prefill"] = rel(rec[p + "ffn.out"][None], a.ffn(rec[p + "ffn.in"][None].to(dev), ids_t))
        r["block_prefill"] = rel(rec[p + "hc_ffn.out"][None], b(rec[p + "hc_attn.in"][None].to(dev).clone(), 0, ids_t))
        da, dk, dm, db = [], [], [], []
        for k in range(1, steps + 1):
            q = f"step{k}.{p}"
            tok = torch.tensor([[tokens[k - 1]]], device=dev)
            at = S + k - 1
            da.append(rel(rec[q + "attn.out"][None], a.attn(rec[q + "attn.in"][None].to(dev).clone(), at)))
            dk.append(rel(rec[q + "attn.kv"][None], a.attn.kv_cache[:1, at % win][:, None]))
            dm.append(rel(rec[q + "ffn.out"][None], a.ffn(rec[q + "ffn.in"][None].to(dev), tok)))
            db.append(rel(rec[q + "hc_ffn.out"][None], b(rec[q + "hc_attn.in"][None].to(dev).clone(), at, tok)))
        if steps:
            r["attn_decode"], r["kv_decode"], r["moe_decode"], r["block_decode"] = max(da), max(dk), max(dm), max(db)
        rows.append(r)
    last = f"layers.{cfg.n_layers - 1}.hc_ffn.out"
    head = lambda x: m_mod.head(x, m_mod.hc_head_fn, m_mod.hc_head_scale, m_mod.hc_head_base, m_mod.norm)  # noqa: E731
    logits = {"prefill": rel(rec["logits"][-1:], head(rec[last][None].to(dev)))}
    if steps:
        logits["decode"] = max(rel(rec[f"step{k}.logits"][-1:], head(rec[f"step{k}.{last}"][None].to(dev)))
                               for k in range(1, steps + 1))
    return rows, logits


def judge(res: OfficialResult) -> None:
    """Fill `failures` and `worst` from the rows and the logits against `LIMITS`."""
    cells = [(k.rsplit("_", 1)[0], k.rsplit("_", 1)[1], f"layer {r['layer']}", v)
             for r in res.rows for k, v in r.items() if k not in ("layer", "kind")]
    cells += [("logits", ph, "head", v) for ph, v in res.logits.items()]
    for what, phase, where, v in cells:
        lim = LIMITS[what]
        if not v <= lim:
            res.failures.append(f"{where} {what} {phase} {100 * v:.3f} % > {100 * lim:g} %")
        if what not in res.worst or v > res.worst[what][0]:
            res.worst[what] = [v, f"{where} {phase}"]


def verify_official(lm, official_dir: str, ids: list[int], steps: int, backend: str, kernel=None,
                    found: tuple[Release, dict] | None = None) -> OfficialResult:
    """Our model `lm` (built in the release's official numerics, bf16) against the official modules in
    `official_dir` on the prompt `ids` and `steps` decode steps, on the model's device. kernel: a stand-in for
    kernel.py (`load_official`; the command never passes one); found: `identify(official_dir)`, where the
    caller has it already."""
    from deepinfer.debug.dumper import run_dump

    release, digests = found or identify(official_dir)
    if lm.model.numerics.release != release.short:
        raise ValueError(f"our model runs {lm.model.numerics.name}, the files are release {release.short}")
    hadamard = hadamard_source()
    run = run_dump(lm.model, ids, steps)
    rec = dict(run.records)
    om = load_official(official_dir, kernel)
    rows, logits = compare_modules(om, lm.model_dir, lm.cfg, ids, run.tokens, rec, steps, str(lm.model.device))
    res = OfficialResult(release.short, digests, backend, lm.cfg.name, len(ids), steps, hadamard, rows, logits)
    judge(res)
    return res
