"""`probe flaggems --screen` on a CPU: recording the model's ATen calls (real names with overloads, shapes, dtypes,
strides), the registration table copy checked against FlagGems' source, the per-op worker with its time budget
(a fake slow op), classification, the allow-list file and `--flaggems @FILE`, and that FlagGems can only be
enabled once the device is chosen. The GPU run itself is one command for the H200 (NOTES)."""

import importlib.abc
import importlib.machinery
import json
import os
import sys
import time
import types

import pytest
import torch
from typer.testing import CliRunner

from deepinfer.debug import flaggems_screen as S
from deepinfer_cli.app import app

runner = CliRunner()
FG_SRC = "/tmp/site-local/flag_gems"


# ------------------------------------------------------------------------------------------ recording
def test_recorder_names_overloads_shapes_dtypes_strides_and_keeps_strided_inputs():
    a = torch.randn(4, 6).t()  # strides (1, 6)
    b = torch.randn(1, 4).expand(6, 4)  # a zero stride
    rec = S.AtenRecorder(capture={"mul.Tensor", "_softmax", "cumsum"}, devices=None)
    with torch.inference_mode(), rec:
        y = a * b
        torch.softmax(y, -1)  # softmax.int decomposes to _softmax, which is what FlagGems registers
        y.to(torch.bfloat16).cumsum(-1)
        torch.eq(y, 0.5)
    assert {"mul.Tensor", "softmax.int", "_softmax", "cumsum", "eq.Scalar", "_to_copy"} <= set(rec.calls)
    (mul,) = rec.calls["mul.Tensor"].values()
    assert mul.spec["args"][0] == {"shape": [6, 4], "dtype": "float32", "stride": [1, 6], "device": "cpu"}
    assert mul.spec["args"][1]["stride"] == [0, 1] and mul.count == 1
    (cs,) = rec.calls["cumsum"].values()
    assert cs.spec["args"][0]["dtype"] == "bfloat16" and cs.spec["args"][1] == -1
    args, _ = mul.inputs
    x0, x1 = S.rebuild(args)
    assert x0.stride() == (1, 6) and x1.stride() == (0, 1) and torch.equal(x0, a) and torch.equal(x1, b)
    assert rec.calls["eq.Scalar"][next(iter(rec.calls["eq.Scalar"]))].why_not == "not in FlagGems' table"


def test_recorder_skips_cpu_calls_by_default_and_caps_signatures():
    rec = S.AtenRecorder(capture=None, max_sigs=2)
    with rec:
        for n in range(1, 5):
            torch.ones(n) + 1
    sigs = list(rec.calls["add.Tensor"].values())
    assert len(sigs) == 2 and all(c.inputs is None and "FlagGems registers CUDA kernels" in c.why_not for c in sigs)


def test_recorder_captures_factory_ops_by_their_device_keyword():
    """zeros / full / arange have no tensor argument: their `device=` says where FlagGems would run them (a "meta"
    device stands in for cuda on a CPU machine)."""
    rec = S.AtenRecorder(capture=None, devices=("meta",))
    with rec:
        torch.zeros(3, device="meta")
        torch.full((2,), 1.5)
    on, off = rec.calls["zeros"], rec.calls["full"]
    assert all(c.inputs is not None and not c.why_not for c in on.values())
    assert all(c.inputs is None and "FlagGems registers" in c.why_not for c in off.values())


@pytest.mark.slow
def test_recording_the_tiny_model():
    """A real prefill + decode step of deepinfer-tiny: the ops FlagGems registers are recorded under their
    registered keys, with the model's own shapes."""
    from deepinfer.engine.loader import load_model
    from deepinfer.ops import ops

    ops.configure("torch", False, {})
    lm = load_model(None, "official", "bfloat16", "cpu", progress=False)
    ids = torch.tensor([lm.tokenizer.encode("北京是中国的首都")])
    table = dict(S.copied_table())
    rec = S.AtenRecorder(capture=set(table), devices=None, max_bytes=64 << 20)
    toks = S.record_run(lm.model, ids, 1, rec)
    assert toks.shape == (1, 2)
    got = set(rec.calls)
    assert {"mm", "_softmax", "add.Tensor", "mul.Tensor", "eq.Scalar", "where.self", "cat", "rsqrt"} <= got
    assert {"mm", "_softmax", "add.Tensor"} <= got & set(table)
    T = ids.size(1)
    assert any(c.spec["args"][0]["shape"][0] == T for c in rec.calls["mm"].values())  # the prefill's rows


# ---------------------------------------------------------------------------------------------- table
def test_table_copy_has_the_real_structure():
    table = S.copied_table()
    keys = dict(table)
    assert len(table) > 400
    assert keys["add.Tensor"] == "add" and keys["_softmax"] == "softmax" and keys["eq.Scalar"] == "eq_scalar"
    assert keys["div.Tensor"] == "true_divide" and keys["mul.Tensor"] == "mul" and keys["rms_norm"] == "rms_norm"
    assert "softmax" not in keys  # the name trap: FlagGems registers _softmax


@pytest.mark.skipif(not os.path.isdir(FG_SRC), reason="FlagGems 5.0.2's source is not extracted here")
def test_table_copy_matches_flaggems_source():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
    try:
        import flaggems_table
    finally:
        sys.path.pop(0)
    from deepinfer.debug.flaggems_table import FULL_CONFIG, VERSION

    real = flaggems_table.read_table(FG_SRC)
    assert [(k, s, c) for k, s, c in FULL_CONFIG] == real
    assert VERSION in open(os.path.join(FG_SRC, "__init__.py")).read()
    defs = flaggems_table.def_names(FG_SRC)
    assert all(s in defs for _, s, _ in FULL_CONFIG)


# --------------------------------------------------------------------------------------- classification
def test_compare_outputs_finds_the_field_notes_defects():
    ref = torch.ones(1, 64, 8) * torch.ones(4, 1, 8)
    st, detail, _ = S.compare_outputs(torch.ones(1, 64, 8), ref)  # mul's broadcast defect: the first shape
    assert st == "wrong_shape" and "(1, 64, 8)" in detail and "(4, 64, 8)" in detail
    x = torch.rand(512, dtype=torch.float32) * 3
    drift = x.bfloat16().float().cumsum(0).bfloat16()
    st, detail, m = S.compare_outputs(drift + 1.0, drift)  # cumsum drift of 1.0 on values up to ~768
    assert st == "wrong" and m["max_abs"] >= 1.0 and "rtol 0.016" in detail
    st, _, _ = S.compare_outputs(drift, drift.clone())
    assert st == "pass"
    st, _, _ = S.compare_outputs((torch.ones(3), torch.tensor([0, 1, 3])), (torch.ones(3), torch.tensor([0, 1, 2])))
    assert st == "wrong"  # indices compare exactly
    st, _, _ = S.compare_outputs(torch.ones(3), torch.ones(3, dtype=torch.bfloat16))
    assert st == "wrong_shape"


def test_classify_never_passes_what_flaggems_does_not_run():
    table = {"mul.Tensor": "mul", "topk": "topk", "rms_norm": "rms_norm"}
    assert S.classify("bitwise_xor.Tensor", table, None)["status"] == "not_registered"
    assert S.classify("mul.Tensor", table, {"registered": False})["status"] == "not_registered"
    assert S.classify("topk", table, {"timed_out": True, "budget": 60.0})["status"] == "too_slow"
    err = {"registered": True, "status": "error", "detail": "TypeError: rms_norm() missing 1 required positional "
                                                             "argument: 'weight'"}
    assert S.classify("rms_norm", table, err)["status"] == "error"
    assert S.classify("mul.Tensor", table, None)["status"] == "not_checked"
    verdicts = [{"key": "div.Tensor", "status": "pass"}, {"key": "div.Scalar", "status": "pass"},
                {"key": "mul.Tensor", "status": "pass"}, {"key": "mul.Tensor", "status": "wrong_shape"},
                {"key": "xor", "status": "not_registered"}]
    allowed, refused = S.allow_list(verdicts, {"div.Tensor": "true_divide", "div.Scalar": "true_divide",
                                               "mul.Tensor": "mul"})
    assert allowed == ["true_divide"] and "wrong_shape" in refused["mul"]


# ------------------------------------------------------------------------------------------- the worker
FAKE_WORKER = r"""
import io, json, os, sys, time, torch
_b = io.BytesIO(); torch.save(torch.ones(3), _b); _b.seek(0); torch.load(_b, weights_only=False)  # warm up first
print(json.dumps({"table": [["topk", "topk"], ["add.Tensor", "add"], ["cat", "cat"]], "version": "fake"}), flush=True)
for line in sys.stdin:
    case = torch.load(line.strip(), weights_only=False)
    if case["key"] == "topk":
        time.sleep(120)  # a compile that blows up
    if case["key"] == "cat":
        os._exit(1)  # a crash
    print(json.dumps({"id": case["id"], "registered": True, "status": "pass", "detail": "ok", "seconds": 0.0}),
          flush=True)
"""


def test_a_slow_op_is_too_slow_and_a_fresh_worker_takes_the_rest(tmp_path):
    t = torch.ones(3)
    calls = [S.OpCall("topk", {}, 1, ([S.snapshot(t), 2], {})), S.OpCall("add.Tensor", {}, 5, ([S.snapshot(t)] * 2, {})),
             S.OpCall("cat", {}, 1, ([[S.snapshot(t)]], {})), S.OpCall("xor", {}, 1, None),
             S.OpCall("add.Tensor", {"x": 1}, 1, None, "capture budget of 1 MiB spent")]
    w = S.Worker([sys.executable, "-c", FAKE_WORKER], startup=60)
    t0 = time.monotonic()
    verdicts, hello = S.check_all(calls, str(tmp_path), 8.0, w)  # 8 s: a loaded 2-core CI box still answers
    assert time.monotonic() - t0 < 60
    st = [v["status"] for v in verdicts]
    assert st == ["too_slow", "pass", "error", "not_registered", "not_checked"], verdicts
    assert "8 s" in verdicts[0]["detail"] and "died" in verdicts[2]["detail"]
    assert "capture budget" in verdicts[4]["detail"]
    assert hello["version"] == "fake" and w.p is None  # stopped
    assert not list(tmp_path.iterdir())  # case files removed
    verdicts, _ = S.check_all(calls[1:2], str(tmp_path), 8.0, S.Worker([sys.executable, "-c", FAKE_WORKER]),
                              deadline=1e-9)
    assert verdicts[0]["status"] == "not_checked" and "deadline" in verdicts[0]["detail"]


# ------------------------------------------------------------------------------------------ allow-list file
def test_allow_list_file_round_trips_through_flaggems_yaml_form_and_the_option(tmp_path, monkeypatch):
    from deepinfer.engine.flaggems_aten import parse_names
    from deepinfer.engine.loader import OptionError
    from deepinfer.outpath import atomic_write

    p = tmp_path / "allow.yaml"
    atomic_write(str(p), S.allow_yaml(["add", "softmax", "true_divide"], ["made by a test"]))
    text = p.read_text()
    assert text.startswith("# made by a test\ninclude:\n  - add\n")
    import yaml

    assert yaml.safe_load(text) == {"include": ["add", "softmax", "true_divide"]}  # what only_enable's loader reads
    assert parse_names(f"@{p}") == ["add", "softmax", "true_divide"]
    (tmp_path / "bad.yaml").write_text("include: 3\n")
    with pytest.raises(OptionError, match="expected `include:`"):
        parse_names(f"@{tmp_path / 'bad.yaml'}")
    r = runner.invoke(app, ["generate", "x", "--flaggems", f"@{tmp_path / 'missing.yaml'}"])
    assert r.exit_code == 2 and "cannot read the allow-list" in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_screen_needs_a_cuda_device_one_line():
    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    r = runner.invoke(app, ["probe", "flaggems", "--screen", "--out", "/tmp/x.yaml"])
    assert r.exit_code == 2 and "needs a CUDA device" in r.output and "Traceback" not in r.output


def test_first_divergence():
    assert S.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert S.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert S.first_divergence([1, 2], [1, 2, 3]) == 2


# ----------------------------------------------------------------------- FlagGems only after the device is set
class _FakeFlagGems(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves a fake `flag_gems` and records the CUDA device in force when it is imported."""

    def __init__(self):
        self.imported_under = []

    def find_spec(self, name, path=None, target=None):
        if name == "flag_gems":
            return importlib.machinery.ModuleSpec(name, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        from deepinfer.debug.flaggems_table import FULL_CONFIG

        self.imported_under.append(_current[0])

        def fn(n):
            f = lambda *a, **k: None  # noqa: E731
            f.__name__ = n
            return f

        module._FULL_CONFIG = tuple((k, fn(f)) for k, f, _ in FULL_CONFIG)
        module.only_enable = lambda include: None


_current = [None]


def test_flag_gems_is_imported_only_under_the_chosen_device(monkeypatch):
    """The field notes: `import flag_gems` creates a CUDA context, and 8 ranks landed on device 0. enable_flaggems
    refuses a non-CUDA device before importing, and imports under torch.cuda.device(<the chosen device>)."""
    from deepinfer.engine.flaggems_aten import enable_flaggems
    from deepinfer.engine.loader import OptionError

    finder = _FakeFlagGems()
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    monkeypatch.delitem(sys.modules, "flag_gems", raising=False)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: object() if n == "flag_gems" else real_find_spec(n, *a))

    class Dev:
        def __init__(self, d):
            self.d = d

        def __enter__(self):
            _current[0] = str(self.d)

        def __exit__(self, *a):
            _current[0] = None

    monkeypatch.setattr(torch.cuda, "device", Dev)
    try:
        with pytest.raises(OptionError, match="needs a CUDA device"):
            enable_flaggems(["add"], torch.device("cpu"))
        assert finder.imported_under == [] and "flag_gems" not in sys.modules
        out = enable_flaggems(["add.Tensor"], torch.device("cuda", 3))
        assert finder.imported_under == ["cuda:3"] and out["functions"] == ["add"]
    finally:
        sys.modules.pop("flag_gems", None)  # the fake must not outlive the test


def test_worker_check_enables_one_function_on_its_own_library_and_unregisters_it():
    """`_check` as the worker runs it, with a fake flag_gems whose only_enable registers the field notes' mul defect
    (the first operand's shape) for the CPU key: wrong_shape, the reference computed before enabling, and plain
    PyTorch again afterwards (the function is registered on a Library of the check's own, destroyed after it)."""
    fake = types.SimpleNamespace(current_work_registrar=None)

    class Reg:
        def __init__(self, keys):
            self.keys = keys

        def get_all_keys(self):
            return self.keys

    def bad_mul(a, b):
        return a.add(a)  # wrong values, and a's shape only (no mul inside: that would recurse)

    def only_enable(lib=None, include=None):
        keys = []
        if "mul" in include:
            lib.impl("mul.Tensor", bad_mul, "CPU")
            keys.append("mul.Tensor")
        fake.current_work_registrar = Reg(keys)

    fake.only_enable = only_enable
    a, b = torch.ones(1, 64, 8), torch.full((4, 1, 8), 3.0)
    case = {"key": "mul.Tensor", "inputs": ([S.snapshot(a), S.snapshot(b)], {})}
    rep = S._check(case, {"mul.Tensor": "mul", "add.Tensor": "add"}, torch.device("cpu"), fake, S.RESOLUTION)
    assert rep["status"] == "wrong_shape" and "(1, 64, 8)" in rep["detail"], rep
    assert torch.equal(a * b, torch.full((4, 64, 8), 3.0))  # unregistered again
    rep = S._check({"key": "add.Tensor", "inputs": ([S.snapshot(a), S.snapshot(a)], {})},
                   {"mul.Tensor": "mul", "add.Tensor": "add"}, torch.device("cpu"), fake, S.RESOLUTION)
    assert rep == {"registered": False}


FAKE_PKG = '''
import types, torch
__version__ = "0-fake"
testing = types.SimpleNamespace(RESOLUTION={torch.float32: 1.3e-6})
def mul(a, b):
    return a.add(a)
def add(a, b):
    return torch.ops.aten.sub.Tensor(a, -b)
_FULL_CONFIG = (("mul.Tensor", mul), ("add.Tensor", add))
current_work_registrar = None
class _Reg:
    def __init__(self, keys):
        self.keys = keys
    def get_all_keys(self):
        return self.keys
def only_enable(lib=None, include=None):
    global current_work_registrar
    keys = [k for k, f in _FULL_CONFIG if f.__name__ in include]
    for k, f in _FULL_CONFIG:
        if k in keys:
            lib.impl(k, f, "CPU")
    current_work_registrar = _Reg(keys)
'''


def test_the_real_worker_over_its_pipe(tmp_path):
    """worker_main itself (on the CPU, a fake flag_gems package on its path): the table it reports, one verdict per
    case over the pipe, its own stdout noise kept off the channel."""
    (tmp_path / "flag_gems").mkdir()
    (tmp_path / "flag_gems" / "__init__.py").write_text(FAKE_PKG + "\nprint('noise on stdout')\n")
    a, b = torch.ones(1, 64, 8), torch.full((4, 1, 8), 3.0)
    calls = [S.OpCall("mul.Tensor", {}, 1, ([S.snapshot(a), S.snapshot(b)], {})),
             S.OpCall("add.Tensor", {}, 1, ([S.snapshot(b), S.snapshot(b)], {}))]
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    verdicts, hello = S.check_all(calls, str(tmp_path), 60.0, S.Worker(S.worker_cmd("cpu"), env=env, startup=120))
    assert hello["version"] == "0-fake" and ["mul.Tensor", "mul"] in hello["table"]
    assert [v["status"] for v in verdicts] == ["wrong_shape", "pass"], verdicts
    assert verdicts[1]["function"] == "add" and verdicts[1]["metric"]["max_abs"] == 0.0


E2E_PKG = '''
import types, torch
__version__ = "0-fake-e2e"
testing = types.SimpleNamespace(RESOLUTION={torch.float32: 1.3e-6, torch.bfloat16: 0.016})
def add(a, b, alpha=1):
    return torch.ops.aten.sub.Tensor(a, b, alpha=-alpha)  # exact: a - (-1) b
def mul(a, b):
    return a.add(a)  # the field notes' defect: the first operand's shape
_FULL_CONFIG = (("add.Tensor", add), ("mul.Tensor", mul))
current_work_registrar = None
_lib = None
class _Reg:
    def __init__(self, keys):
        self.keys = keys
    def get_all_keys(self):
        return self.keys
def only_enable(lib=None, include=None):
    global current_work_registrar, _lib
    if lib is None:
        _lib = lib = torch.library.Library("aten", "IMPL")
    keys = [k for k, f in _FULL_CONFIG if f.__name__ in include]
    for k, f in _FULL_CONFIG:
        if k in keys:
            lib.impl(k, f, "CPU")
    current_work_registrar = _Reg(keys)
'''


@pytest.mark.slow
def test_the_screen_end_to_end_on_a_cpu_with_a_fake_flaggems(tmp_path, monkeypatch):
    """run_screen on deepinfer-tiny (CPU, torch backend) against a fake FlagGems with a correct add and the mul
    broadcast defect: add allowed, mul refused as wrong_shape, the file in only_enable form, and the model run
    with the allow-list token-identical and deterministic (this add is exact)."""
    pkg = tmp_path / "site" / "flag_gems"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(E2E_PKG)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = tmp_path / "allow.yaml"
    try:
        rep = S.run_screen(None, "torch", "cpu", steps=1, budget=60, out=str(out), require_cuda=False, per_op=2,
                           worker=S.Worker(S.worker_cmd("cpu"), env=env, startup=120))
        st = {(v["key"], v["status"]) for v in rep["verdicts"]}
        assert ("add.Tensor", "pass") in st
        assert {s_ for k, s_ in st if k == "mul.Tensor"} <= {"wrong", "wrong_shape"}  # same-shape calls: wrong values
        assert rep["allowed"] == ["add"] and "mul" in rep["refused"], (rep["allowed"], rep["refused"])
        assert all(v["status"] == "not_registered" for v in rep["verdicts"] if v["key"] not in ("add.Tensor", "mul.Tensor"))
        assert S.read_allow_yaml(str(out)) == ["add"]
        assert rep["recording_transparent"] and rep["token_identical"] and rep["deterministic"]
        assert rep["enabled"]["functions"] == ["add"] and rep["flag_gems_version"] == "0-fake-e2e"
    finally:
        fg = sys.modules.pop("flag_gems", None)
        if fg is not None and fg._lib is not None:
            fg._lib._destroy()


def test_a_reference_that_cannot_replay_is_not_blamed_on_flaggems():
    fake = types.SimpleNamespace(current_work_registrar=None, only_enable=lambda lib=None, include=None: None)
    case = {"key": "mm", "inputs": ([S.snapshot(torch.ones(2, 3)), S.snapshot(torch.ones(2, 3))], {})}
    rep = S._check(case, {"mm": "mm"}, torch.device("cpu"), fake, S.RESOLUTION)
    assert rep["status"] == "not_checked" and "PyTorch itself fails" in rep["detail"]
    assert S.classify("mm", {"mm": "mm"}, rep)["status"] == "not_checked"


def test_probe_include_of_an_unknown_name_is_one_line_with_close_matches(monkeypatch):
    import deepinfer.debug.probes as P

    monkeypatch.setattr(P, "probe_flaggems", lambda names: {
        "probe": "flaggems", "installed": True, "version": "5.0.2", "requested": names, "resolved": {},
        "unresolved": {"softmaxx": ["softmax", "_softmax"]}, "registered": [], "rows": [], "ok": True})
    r = runner.invoke(app, ["probe", "flaggems", "--include", "softmaxx"])
    assert r.exit_code == 2 and "softmaxx (close: softmax, _softmax)" in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_screen_options_without_the_screen_are_refused():
    """`probe flaggems --out a.yaml --steps -5 --budget -1` ran the plain probe with every screen option ignored
    (sweep of 2026-12-08): one line naming them, exit 2."""
    r = runner.invoke(app, ["probe", "flaggems", "--out", "/tmp/never.yaml", "--steps", "-5", "--budget", "-1"])
    assert r.exit_code == 2 and "--out, --steps, --budget: options of `probe flaggems --screen`" in r.output
    assert len(r.output.strip().splitlines()) == 1 and not os.path.exists("/tmp/never.yaml")
