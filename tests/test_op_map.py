"""The per-op backend map (`--op op=backend,...`, DEEPINFER_OPS): parsing, resolution op by op, strictness
and fallbacks per mapped backend, the missing-package line, and where the map is recorded (dump fingerprint,
bench rows, probe kernels)."""

import json

import h5py
import pytest
from backend_device import device_for
from typer.testing import CliRunner

from deepinfer.ops.registry import REGISTRY, BackendError, Dispatcher, op_map_str, parse_op_map
from deepinfer_cli.app import app

pytest.importorskip("triton")


def test_parse_op_map():
    assert parse_op_map("grouped_gemm=tilelang, sparse_attn_fp8=triton") == {"grouped_gemm": "tilelang",
                                                                             "sparse_attn_fp8": "triton"}
    assert parse_op_map("") == {} and parse_op_map(None) == {}
    assert op_map_str({"b_op": "triton", "a_op": "torch"}) == "a_op=torch,b_op=triton"
    with pytest.raises(ValueError, match="unknown op 'gemm'; ops: rms_norm, act_quant"):
        parse_op_map("gemm=triton")
    with pytest.raises(ValueError, match="unknown backend 'cuda'; backends: torch, triton, tilelang"):
        parse_op_map("rms_norm=cuda")
    with pytest.raises(ValueError, match="expected op=backend"):
        parse_op_map("rms_norm")


def test_each_op_resolves_to_its_own_backend():
    d = Dispatcher().configure("torch", False, {"rms_norm": "triton"})
    assert d.backend_of("rms_norm") == "triton" and d.backend_of("act_quant") == "torch"
    assert d.resolve("rms_norm") is REGISTRY["rms_norm"].impls["triton"]
    assert d.resolve("act_quant") is REGISTRY["act_quant"].ref
    assert d.backends() == ["torch", "triton"] and d.describe() == "torch; rms_norm=triton"
    d.configure("triton", False, {"rms_norm": "torch"})  # the other way round
    assert d.resolve("rms_norm") is REGISTRY["rms_norm"].ref
    assert d.resolve("act_quant") is REGISTRY["act_quant"].impls["triton"]
    assert d.fallbacks == {}


def test_a_fused_op_left_out_of_the_map_follows_its_mapped_parts(monkeypatch):
    """`--op fp8_gemm=triton` on the torch backend: act_quant_fp8_gemm (act_quant then fp8_gemm, wo_b's Linear) is
    not in the map, so it runs composed from its parts as mapped -- Triton's fp8_gemm after the torch act_quant --
    not wholly on the backend (a map naming fp8_gemm reaches every FP8 GEMM). A fused op the map names, or one
    none of whose parts it names, resolves as before; a phase-split part makes the fused op follow the phase."""
    import torch

    import deepinfer_kernels.triton  # noqa: F401  (registers the implementations)

    seen = []
    real = REGISTRY["fp8_gemm"].impls["triton"]
    monkeypatch.setitem(REGISTRY["fp8_gemm"].impls, "triton", lambda *a, **k: seen.append(1) or real(*a, **k))
    d = Dispatcher().configure("torch", False, {"fp8_gemm": "triton"})
    x = torch.randn(3, 256)
    w, ws = (torch.randn(128, 256) * 30).to(torch.float8_e4m3fn), torch.ones(1, 2)
    want = REGISTRY["act_quant_fp8_gemm"].ref(x, w, ws, torch.float32)  # on the CPU
    dev = device_for("triton")  # Triton's fp8_gemm: interpreted on a CPU, compiled on a CUDA host
    x, w, ws = x.to(dev), w.to(dev), ws.to(dev)
    y = d.resolve("act_quant_fp8_gemm")(x, w, ws, torch.float32)
    assert seen == [1] and d.fallbacks == {}
    torch.testing.assert_close(y.cpu(), want, rtol=1e-5, atol=1e-4)
    assert Dispatcher().configure("torch", False, {"act_quant_fp8_gemm": "torch", "fp8_gemm": "triton"}).resolve(
        "act_quant_fp8_gemm") is REGISTRY["act_quant_fp8_gemm"].ref
    assert Dispatcher().configure("triton", False, {"sparse_attn": "torch"}).resolve(
        "act_quant_fp8_gemm") is REGISTRY["act_quant_fp8_gemm"].impls["triton"]
    d = Dispatcher().configure("torch", False, "fp8_gemm=decode:triton/prefill:torch")
    seen.clear()
    d.phase = "prefill"
    d.resolve("act_quant_fp8_gemm")(x, w, ws, torch.float32)
    assert seen == []
    d.phase = "decode"
    d.resolve("act_quant_fp8_gemm")(x, w, ws, torch.float32)
    assert seen == [1]


def test_a_map_naming_the_fused_ops_own_backend_keeps_the_fused_kernel():
    """A map (a tuned one, say) that sends a part to the backend the fused op runs on anyway -- grouped_gemm=triton on
    the Triton backend -- leaves the fused kernel in place (swiglu_grouped_gemm's w2 computing its own A, not
    swiglu_quant then grouped_gemm); per phase, where a phase split sends the part elsewhere only in one."""
    import deepinfer_kernels.triton  # noqa: F401  (registers the implementations)

    fused = REGISTRY["swiglu_grouped_gemm"].impls["triton"]
    assert Dispatcher().configure("triton", False, {"grouped_gemm": "triton"}).resolve("swiglu_grouped_gemm") is fused
    assert Dispatcher().configure("triton", False, {"fp8_gemm": "triton"}).resolve(
        "act_quant_fp8_gemm") is REGISTRY["act_quant_fp8_gemm"].impls["triton"]
    d = Dispatcher().configure("triton", False, "grouped_gemm=decode:triton/prefill:torch")
    d.phase = "decode"
    assert d.resolve("swiglu_grouped_gemm") is fused
    d.phase = "prefill"
    got = d.resolve("swiglu_grouped_gemm")
    assert got is not fused and got is not REGISTRY["swiglu_grouped_gemm"].ref  # composed: torch's grouped_gemm


def test_a_mapped_backend_without_the_op_falls_back_visibly_or_refuses_under_strict(monkeypatch, capsys):
    monkeypatch.delitem(REGISTRY["swiglu"].impls, "triton")
    d = Dispatcher().configure("torch", False, "swiglu=triton")
    assert d.resolve("swiglu") is REGISTRY["swiglu"].ref
    assert d.fallbacks == {"swiglu": "backend 'triton' has no implementation"}
    assert "op swiglu falls back to the torch reference" in capsys.readouterr().err
    with pytest.raises(BackendError, match=r"--strict: backend 'torch' with --op swiglu=triton lacks 1 op\(s\): swiglu"):
        Dispatcher().configure("torch", True, "swiglu=triton")


def test_the_setting_is_the_default_map(monkeypatch):
    monkeypatch.setenv("DEEPINFER_OPS", "rms_norm=triton")
    assert Dispatcher().configure("torch", False).op_map == {"rms_norm": "triton"}
    assert Dispatcher().configure("torch", False, {}).op_map == {}  # an explicit map wins
    monkeypatch.setenv("DEEPINFER_OPS", "rms_norm=gpu")
    with pytest.raises(ValueError, match="DEEPINFER_OPS 'rms_norm=gpu': unknown backend"):
        Dispatcher().configure("torch", False)


def test_a_backend_not_installed_is_one_line_naming_package_and_extra():
    pytest.importorskip("deepinfer_kernels")
    try:
        import tilelang  # noqa: F401
        pytest.skip("tilelang is installed here")
    except ImportError:
        pass
    with pytest.raises(BackendError, match=r"backend 'tilelang' needs the tilelang package, which is not "
                                           r"installed: pip install -e '\.\[tilelang\]'"):
        Dispatcher().configure("torch", False, "grouped_gemm=tilelang")
    r = CliRunner().invoke(app, ["generate", "北京是", "-n", "1", "--op", "grouped_gemm=tilelang"])
    assert r.exit_code == 2 and "pip install -e '.[tilelang]'" in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("op,msg", [("bogus=triton", "unknown op 'bogus'; ops: rms_norm"),
                                    ("rms_norm=cuda", "unknown backend 'cuda'; backends: torch, triton, tilelang")])
def test_cli_bad_map_is_one_line_exit_2(op, msg):
    for cmd in (["generate", "北京是", "-n", "1"], ["dump", "北京是", "--steps", "1"], ["probe", "kernels"]):
        r = CliRunner().invoke(app, [*cmd, "--op", op])
        assert r.exit_code == 2 and msg in r.output and "Traceback" not in r.output, (cmd, r.output)


def test_cli_mapped_kernel_backend_needs_cuda_or_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    r = CliRunner().invoke(app, ["generate", "北京是", "-n", "1", "--device", "cpu", "--op", "rms_norm=triton"])
    assert r.exit_code == 2 and "--op backend triton needs a CUDA device" in r.output, r.output


def test_dump_records_the_map(monkeypatch, tmp_path, tiny_dir):
    """A dump with rms_norm on Triton (fp32: under the interpreter on a CPU, compiled on a CUDA host's GPU) runs and
    its fingerprint holds the map."""
    dev = device_for("triton")
    if dev == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "d.h5"
    r = CliRunner().invoke(app, ["dump", "北京", "--steps", "1", "--dtype", "float32", "--device", dev,
                                 "--op", "rms_norm=triton", "--out", str(out)])
    assert r.exit_code == 0, r.output
    with h5py.File(out) as f:
        assert f.attrs["op_map"] == "rms_norm=triton" and f.attrs["backend"] == "torch"


def test_probe_kernels_shows_the_map():
    r = CliRunner().invoke(app, ["probe", "kernels", "--op", "rms_norm=triton", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    rows = {row["op"]: row for row in d["ops"]}
    assert d["op_map"] == "rms_norm=triton"
    assert rows["rms_norm"]["backend_here"] == "triton" and rows["act_quant"]["backend_here"] == d["default_backend"]


def test_bench_cell_carries_the_map():
    from deepinfer_cli.bench import _backend_cell

    assert _backend_cell({"backend": "triton", "op_map": "grouped_gemm=tilelang"}) == \
        "triton (--op grouped_gemm=tilelang)"
    assert _backend_cell({"backend": "triton", "op_map": ""}) == "triton"


def test_specs_carry_the_map():
    """`margin` / `bisect` SPECs take the map as op.NAME=BACKEND keys; bisect's test implementation of an op is
    its mapped backend's."""
    from deepinfer.debug.bisect import backend_impls
    from deepinfer.debug.margin import parse_spec, spec_str

    s = parse_spec("backend=torch,op.rms_norm=triton,op.act_quant=torch", "--test")
    assert s["ops"] == {"rms_norm": "triton", "act_quant": "torch"}
    assert spec_str(s) == "backend=torch,numerics=official,dtype=bfloat16,op.act_quant=torch,op.rms_norm=triton"
    with pytest.raises(ValueError, match="unknown op 'bogus'"):
        parse_spec("op.bogus=triton", "--test")
    impl = backend_impls("torch", s["ops"])
    assert impl("rms_norm") is REGISTRY["rms_norm"].impls["triton"] and impl("swiglu") is REGISTRY["swiglu"].ref


def test_bisect_over_a_map_that_changes_nothing_agrees(tiny_dir):
    r = CliRunner().invoke(app, ["bisect", "北京是", "--ref", "backend=torch,dtype=float32",
                                 "--test", "backend=torch,dtype=float32,op.rms_norm=torch", "--steps", "2", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output.strip().splitlines()[-1])
    assert d["agree"] and d["test"].endswith("op.rms_norm=torch")


def test_a_site_override_of_a_part_reaches_the_fused_op():
    """bisect / graft override ops per (name, layer): overriding hc_post at layer 2 runs hc_post_pre_quant composed
    there, with that hc_post; other layers keep the fused op; `sited` tells the model not to defer post-mixes."""
    import torch

    seen = []
    ref = REGISTRY["hc_post"].ref
    d = Dispatcher().configure("torch", False, {})
    assert not d.sited
    d.override_sites({("hc_post", 2): lambda *a, **k: seen.append(1) or ref(*a, **k)})
    assert d.sited
    d.layer = 1
    assert d.resolve("hc_post_pre_quant") is REGISTRY["hc_post_pre_quant"].ref
    d.layer = 2
    g = torch.Generator().manual_seed(0)
    x, res = torch.randn(1, 1, 256, generator=g), torch.randn(1, 1, 4, 256, generator=g)
    post, comb = torch.rand(1, 1, 4, generator=g), torch.rand(1, 1, 4, 4, generator=g)
    fn, scale = torch.randn(24, 1024, generator=g) * 0.03, torch.rand(3, generator=g) + 0.5
    base = torch.randn(24, generator=g)
    out = d.resolve("hc_post_pre_quant")(x, res, post, comb, fn, scale, base, 1e-6, 1e-6, 20, None, 1e-6)
    assert seen == [1]
    want = REGISTRY["hc_post_pre_quant"].ref(x, res, post, comb, fn, scale, base, 1e-6, 1e-6, 20, None, 1e-6)
    assert all(torch.equal(a.float(), b.float()) for a, b in zip(out, want))
    d.override_sites(None)
    assert not d.sited
