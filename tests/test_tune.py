"""`deepinfer tune` and the per-op map by phase: the fastest correct kernel per op and phase, the map file it
writes, and the refusals of a map measured elsewhere. Timings are injected here (CPU); on a GPU they are
`ab.bench`'s."""

import re

import pytest
import torch
import yaml
from backend_device import device_for
from typer.testing import CliRunner

from deepinfer.debug import tune as tune_mod
from deepinfer.debug.tune import tune, write_map
from deepinfer.engine.loader import load_model
from deepinfer.ops import ops
from deepinfer.ops.op_map_file import load_op_map
from deepinfer.ops.registry import REGISTRY, Dispatcher, op_map_str, parse_op_map
from deepinfer_cli.app import app

OPS = "rms_norm$|act_quant$"
# where the Triton candidates run: tuning calls each candidate on its cases, and a compiled Triton kernel (a CUDA
# host) cannot read CPU tensors
DEV = device_for("triton")


def _timer(table):
    """A timer giving each (op, backend) a fixed ms: which backend a call is, from its implementation."""
    def timer(op, fn, args, kwargs):
        b = next((b for b, f in REGISTRY[op].impls.items() if f is fn), "torch")
        return table[(op, b)]
    return timer


def test_fastest_correct_per_phase_and_the_baseline_on_ties():
    t = {("rms_norm", "torch"): 1.0, ("rms_norm", "triton"): 2.0, ("act_quant", "torch"): 3.0,
         ("act_quant", "triton"): 3.0}
    res = tune("triton", ["torch", "triton"], OPS, "tiny", 0, DEV, timer=_timer(t))
    # per case: tiny rms_norm has 2 cases per phase, act_quant 1: the sums decide
    assert res["ops"] == {"rms_norm": "torch", "act_quant": "triton"}  # a tie keeps the baseline
    rms = [c for c in res["choices"] if c.op == "rms_norm"]
    assert {c.phase for c in rms} == {"decode", "prefill"} and all(c.candidates["torch"].ms == 2.0 for c in rms)


def test_a_phase_split(monkeypatch):
    """decode and prefill may pick different backends: the entry becomes {decode: .., prefill: ..}."""
    calls = []

    def timer(op, fn, args, kwargs):
        b = next((b for b, f in REGISTRY[op].impls.items() if f is fn), "torch")
        rows = args[0].numel() // args[0].size(-1)
        calls.append((op, b, rows))
        return (1.0 if b == "triton" else 2.0) if rows < 10 else (2.0 if b == "triton" else 1.0)

    res = tune("triton", ["torch", "triton"], "act_quant$", "tiny", 0, DEV, timer=timer)
    assert res["ops"] == {"act_quant": {"decode": "triton", "prefill": "torch"}}, calls


def test_wrong_or_falling_back_kernels_are_not_eligible(monkeypatch):
    ref = REGISTRY["act_quant"].ref

    def wrong(x, block=128):
        q, s = ref(x, block)
        return q, s * 2  # every scale off by 2x
    monkeypatch.setitem(REGISTRY["act_quant"].impls, "triton", wrong)
    res = tune("triton", ["torch", "triton"], "act_quant$", "tiny", 0, "cpu",
               timer=lambda *a: 1.0)
    c = next(c for c in res["choices"] if c.op == "act_quant")
    assert not c.candidates["triton"].eligible and "off by" in c.candidates["triton"].reason
    assert res["ops"]["act_quant"] == "torch"

    def falls_back(x, block=128):
        ops.runtime_fallback("act_quant", "a kernel that did not build")
        return ref(x, block)
    monkeypatch.setitem(REGISTRY["act_quant"].impls, "triton", falls_back)
    res = tune("triton", ["torch", "triton"], "act_quant$", "tiny", 0, "cpu", timer=lambda *a: 1.0)
    c = next(c for c in res["choices"] if c.op == "act_quant")
    assert not c.candidates["triton"].eligible and "did not build" in c.candidates["triton"].reason
    assert ops.strict is False  # restored after tuning


def test_bad_arguments():
    with pytest.raises(ValueError, match="--policy 'nope': choose official or fast"):
        tune(policy="nope")
    with pytest.raises(ValueError, match="V4 shapes need a CUDA device"):
        tune("triton", ["torch", "triton"], OPS, "flash", 0, "cpu")
    with pytest.raises(ValueError, match="--baseline 'tilelang' is not among"):
        tune("tilelang", ["torch", "triton"], OPS, "tiny", 0, "cpu")
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        tune("triton", ["nope"], OPS, "tiny", 0, "cpu")


def test_a_named_candidate_that_cannot_run_here_is_refused(monkeypatch):
    """`tune --candidates torch,triton` on a CPU without the interpreter tabled Triton's every op as failing (an
    AssertionError per op) and wrote a map; a candidate the user names must run on the device (sweep 2026-12-08)."""
    from deepinfer import settings

    # imported first, interpreted as the session is: its module-level INTERPRET must not see the patch below
    pytest.importorskip("deepinfer_kernels.triton")
    monkeypatch.setattr(settings, "triton_interpreted", lambda: False)
    with pytest.raises(ValueError, match="--candidates triton needs a CUDA device"):
        tune("torch", ["torch", "triton"], OPS, "tiny", 0, "cpu")


def test_map_file_round_trip_and_refusals(tmp_path, monkeypatch):
    t = {("rms_norm", "torch"): 1.0, ("rms_norm", "triton"): 2.0, ("act_quant", "torch"): 5.0,
         ("act_quant", "triton"): 3.0}
    res = tune("triton", ["torch", "triton"], OPS, "tiny", 0, DEV, timer=_timer(t))
    path = tmp_path / "m.yaml"
    write_map(str(path), res, "deepinfer tune -o m.yaml")
    assert load_op_map(str(path)) == {"rms_norm": "torch", "act_quant": "triton"}
    assert parse_op_map(f"@{path}") == {"rms_norm": "torch", "act_quant": "triton"}
    doc = yaml.safe_load(path.read_text())
    assert doc["measured"]["rms_norm"]["prefill"]["torch"] == {"ms": 2.0, "drift": 0.0} and doc["tuned"]["baseline"] == "triton"

    def variant(name, **change):
        d = yaml.safe_load(path.read_text())
        for k, v in change.items():
            d[k] = v
        p = tmp_path / f"{name}.yaml"
        p.write_text(yaml.safe_dump(d))
        return str(p)
    from deepinfer.ops.op_map_file import device_name

    here = device_name()  # "cpu", or this CUDA host's GPU: a map from another device is refused
    there = "NVIDIA H100 80GB HBM3" if here != "NVIDIA H100 80GB HBM3" else "NVIDIA H200"
    with pytest.raises(ValueError, match=re.escape(f"tuned on '{there}', this machine has '{here}'")):
        load_op_map(variant("gpu", device=there))
    with pytest.raises(ValueError, match="another backend set: triton 3.0.0 there"):
        load_op_map(variant("ver", backends={**doc["backends"], "triton": "3.0.0"}))
    with pytest.raises(ValueError, match="policy 'fast'; this run's is 'official'"):
        load_op_map(variant("pol", policy="fast"))
    monkeypatch.setenv("DEEPINFER_POLICY", "fast")  # a fast run takes the fast map, refuses the official one
    assert load_op_map(variant("pol2", policy="fast")) == {"rms_norm": "torch", "act_quant": "triton"}
    with pytest.raises(ValueError, match="policy 'official'; this run's is 'fast'"):
        load_op_map(str(path))
    monkeypatch.delenv("DEEPINFER_POLICY")
    with pytest.raises(ValueError, match="not a tuned op map"):
        load_op_map(variant("fmt", format="something"))
    # a kernel backend installed here that was not installed there: the map never considered it (the map says
    # tilelang was missing there whatever this host has, so a host with TileLang installed refuses it too)
    from deepinfer.ops import registry
    real = registry.backend_versions
    monkeypatch.setattr(registry, "backend_versions",
                        lambda bs=None: {**real(bs), **({"tilelang": "0.1.15"} if bs is None else {})})
    with pytest.raises(ValueError, match="tilelang 0.1.15 installed here, not there"):
        load_op_map(variant("new", installed={b: v for b, v in doc["installed"].items() if b != "tilelang"}))


def test_phase_split_resolves_by_the_model_step(capsys):
    """A phase-split entry sends the op to one backend inside prefill and another inside decode; the map prints
    and parses back the same (the decode runner re-captures on a changed description)."""
    text = "rms_norm=decode:triton/prefill:torch"
    m = parse_op_map(text)
    assert m == {"rms_norm": {"decode": "triton", "prefill": "torch"}} and op_map_str(m) == text
    d = Dispatcher().configure("torch", strict=False, op_map=m)
    assert "triton" in d.backends() and d.missing() == []
    d.phase = "decode"
    assert d.resolve("rms_norm") is REGISTRY["rms_norm"].impls["triton"]
    d.phase = "prefill"
    assert d.resolve("rms_norm") is REGISTRY["rms_norm"].ref
    for bad, msg in (("rms_norm=decode:triton", "names every phase"), ("rms_norm=warm:triton/prefill:torch",
                                                                       "phase:backend"),
                     ("rms_norm=decode:nope/prefill:torch", "unknown backend 'nope'")):
        with pytest.raises(ValueError, match=msg):
            parse_op_map(bad)
    # in the model: prefill steps take the prefill entry, decode steps the decode one
    seen = []
    ops.configure("torch", strict=False, op_map={"rms_norm": {"decode": "triton", "prefill": "torch"}})
    try:
        lm = load_model(None, "official", "float32", "cpu", progress=False)
        real = {b: (REGISTRY["rms_norm"].impls["triton"] if b == "triton" else REGISTRY["rms_norm"].ref)
                for b in ("triton", "torch")}
        ops._cache.clear()
        ops._cache[("rms_norm", "decode")] = lambda *a, **k: (seen.append("decode"), real["torch"](*a, **k))[1]
        ops._cache[("rms_norm", "prefill")] = lambda *a, **k: (seen.append("prefill"), real["torch"](*a, **k))[1]
        lm.model.allocate(1, 16)
        lm.model.prefill(torch.tensor([[0, 5, 6]]))
        n = len(seen)
        lm.model.decode(torch.tensor([[7]]), torch.tensor([3]))
        assert set(seen[:n]) == {"prefill"} and set(seen[n:]) == {"decode"} and n and len(seen) > n
    finally:
        ops.configure("torch", strict=False, op_map={})


def test_cli(tmp_path):
    r = CliRunner().invoke(app, ["tune", "-o", str(tmp_path / "m.yaml"), "--shapes", "flash", "--device", "cpu"])
    assert r.exit_code == 2 and "V4 shapes need a CUDA device" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(app, ["tune", "-o", str(tmp_path), "--shapes", "tiny"])
    assert r.exit_code == 2 and "--out" in r.output
    out = tmp_path / "m.yaml"
    r = CliRunner().invoke(app, ["tune", "-o", str(out), "--shapes", "tiny", "--ops", "act_quant$",
                                 "--candidates", "torch", "--baseline", "torch", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    # triton, installed here and there, was left out by choice: the map still holds here
    assert "nothing was timed" in r.output and load_op_map(str(out)) == {"act_quant": "torch"}
    r = CliRunner().invoke(app, ["tune", "-o", str(out), "--shapes", "tiny", "--ops", "act_quant$",
                                 "--candidates", "torch", "--baseline", "torch", "--device", "cpu", "--json"])
    import json
    d = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.exit_code == 0 and d["policy"] == "official" and d["measured"]["act_quant"]["decode"]["torch"]["drift"] == 0


def test_phase_split_through_the_toolkit():
    """A phase split travels through SPECs (margin, bisect), probe kernels and the CLI without a crash: shown per
    phase where it applies, refused in one line where one implementation per site is needed (bisect)."""
    from deepinfer.debug.bisect import backend_impls
    from deepinfer.debug.margin import parse_spec, spec_str
    from deepinfer.debug.probes import probe_kernels

    s = parse_spec("backend=torch,op.rms_norm=decode:triton/prefill:torch")
    assert s["ops"] == {"rms_norm": {"decode": "triton", "prefill": "torch"}}
    assert parse_spec(spec_str(s)) == s
    row = next(r for r in probe_kernels("rms_norm=decode:triton/prefill:torch")["ops"] if r["op"] == "rms_norm")
    assert row["backend_here"] == "decode:triton/prefill:torch" and row["here"] == "decode: used; prefill: used"
    with pytest.raises(ValueError, match="give rms_norm one backend, not a phase split"):
        backend_impls("torch", s["ops"])
    r = CliRunner().invoke(app, ["bisect", "x", "--ref", "backend=torch", "--test",
                                 "backend=torch,op.rms_norm=decode:torch/prefill:torch"])
    assert r.exit_code == 2 and "phase split" in r.output and "Traceback" not in r.output


def _triton_promotes_per_128k(monkeypatch, op: str) -> None:
    """The Triton backend's facts say its `op` promotes FP8 sums once per 128-K block (`per_128k_ops`)."""
    from deepinfer.ops import registry

    real = registry.backend_facts
    monkeypatch.setattr(registry, "backend_facts", lambda b, dev: {**real(b, dev), "per_128k_ops": [op]}
                        if b == "triton" else real(b, dev))


def test_official_policy_keeps_per_128k_promotion_out(monkeypatch):
    """A candidate whose backend promotes an op's FP8 sums once per 128-K block (its `per_128k_ops` fact) is not
    eligible under `official`, and is under `fast`; every candidate's drift against the reference is recorded."""
    _triton_promotes_per_128k(monkeypatch, "act_quant")
    t = {("act_quant", "torch"): 5.0, ("act_quant", "triton"): 1.0}
    off = tune("triton", ["torch", "triton"], "act_quant$", "tiny", 0, DEV, "official", timer=_timer(t))
    c = next(c for c in off["choices"] if c.op == "act_quant")
    assert not c.candidates["triton"].eligible and "per 128-K block" in c.candidates["triton"].reason
    assert off["ops"]["act_quant"] == "torch" and c.candidates["triton"].drift is not None
    fast = tune("triton", ["torch", "triton"], "act_quant$", "tiny", 0, DEV, "fast", timer=_timer(t))
    c = next(c for c in fast["choices"] if c.op == "act_quant")
    assert c.candidates["triton"].eligible and fast["ops"]["act_quant"] == "triton"
    assert c.candidates["torch"].drift == 0.0 and c.candidates["triton"].to_dict()["drift"] is not None


def test_a_fused_op_inherits_its_parts_per_128k_promotion(monkeypatch):
    """act_quant_fp8_gemm is act_quant then fp8_gemm: where a backend's fp8_gemm promotes per 128-K block (its
    `per_128k_ops` fact names only fp8_gemm), the fused op is kept out under `official` too."""
    _triton_promotes_per_128k(monkeypatch, "fp8_gemm")
    t = {("act_quant_fp8_gemm", "torch"): 5.0, ("act_quant_fp8_gemm", "triton"): 1.0}
    off = tune("triton", ["torch", "triton"], "act_quant_fp8_gemm$", "tiny", 0, DEV, "official", timer=_timer(t))
    c = next(c for c in off["choices"] if c.op == "act_quant_fp8_gemm")
    assert not c.candidates["triton"].eligible and "per 128-K block" in c.candidates["triton"].reason
    assert off["ops"]["act_quant_fp8_gemm"] == "torch"


def test_tune_measures_under_its_policy(monkeypatch):
    """The kernels are measured under the policy's own defaults (`settings.FAST_DEFAULTS`): under fast, Triton's
    prefill fp8_gemm is the per-128 one (its fact says so) and the environment is put back afterwards."""
    from deepinfer import settings
    from deepinfer_kernels.triton import facts

    monkeypatch.delenv("DEEPINFER_POLICY", raising=False)
    monkeypatch.delenv("DEEPINFER_FP8_GEMM", raising=False)
    seen = []
    progress = lambda op, ph, b: seen.append((settings.choice("DEEPINFER_FP8_GEMM"),  # noqa: E731
                                             "fp8_gemm" in facts(torch.device("cpu"))["per_128k_ops"]))
    tune("triton", ["torch", "triton"], "act_quant$", "tiny", 0, DEV, "fast", timer=lambda *a: 1.0,
         progress=progress)
    assert seen and set(seen) == {("auto", True)}
    seen.clear()
    tune("triton", ["torch", "triton"], "act_quant$", "tiny", 0, DEV, "official", timer=lambda *a: 1.0,
         progress=progress)
    assert set(seen) == {("exact", False)}
    assert "DEEPINFER_POLICY" not in __import__("os").environ and settings.choice("DEEPINFER_FP8_GEMM") == "exact"
