"""`deepinfer verify --against official`: the release is identified by the files' sha256 before anything runs, an
unknown digest is one line and exit 2; what runs on the GPU (`deepinfer.debug.official`) is judged against
fixed limits. The comparison itself needs CUDA and TileLang (the `gpu` test at the end)."""

import json
import os

import pytest
import torch
from typer.testing import CliRunner

from deepinfer.debug import official
from deepinfer.model import numerics
from deepinfer_cli.app import app

RELEASE_DIR = os.path.join(os.path.dirname(__file__), "..", "tools", "official", "release")


def _files(tmp_path, model=b"m = 1\n", kernel=b"k = 1\n"):
    d = tmp_path / "official"
    d.mkdir()
    (d / "model.py").write_bytes(model)
    (d / "kernel.py").write_bytes(kernel)
    return d


def _fake_releases(monkeypatch, d):
    """Releases whose digests are those of files written here: the mechanism, without DeepSeek's files (which
    are read, never committed)."""
    import hashlib

    cur = numerics.Release("60d8d70770c6", "current", hashlib.sha256(b"m = 1\n").hexdigest(),
                           hashlib.sha256(b"k = 1\n").hexdigest(), kv_qat=True, shared_clamp=True)
    ini = numerics.Release("efc855127ecb", "initial", hashlib.sha256(b"m = 0\n").hexdigest(),
                           hashlib.sha256(b"k = 0\n").hexdigest(), kv_qat=False, shared_clamp=False)
    monkeypatch.setattr(official, "OFFICIAL_RELEASES", {"60d8d707": cur, "efc85512": ini})


def test_digests_name_the_release(tmp_path, monkeypatch):
    d = _files(tmp_path)
    _fake_releases(monkeypatch, d)
    rel, digests = official.identify(str(d))
    assert rel.short == "60d8d707" and digests["model.py"] == official.sha256(str(d / "model.py"))
    (d / "kernel.py").write_bytes(b"k = 0\n")  # the initial release's kernel beside the current model
    with pytest.raises(ValueError, match="model.py is release 60d8d707, kernel.py release efc85512"):
        official.identify(str(d))


def test_unknown_digest_is_refused_in_one_line(tmp_path):
    """An edited copy: one line naming the file, its digest and the known releases; exit 2, before any CUDA or
    TileLang check (this machine has neither)."""
    d = _files(tmp_path, model=b"# edited\n")
    r = CliRunner().invoke(app, ["verify", "--against", "official", "--official-dir", str(d)])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    digest = official.sha256(str(d / "model.py"))
    assert len(lines) == 1 and str(d / "model.py") in lines[0] and digest in lines[0], r.output
    assert "60d8d707" in lines[0] and "efc85512" in lines[0] and "Traceback" not in r.output


@pytest.mark.parametrize("args,msg", [
    ([], "--official-dir"),
    (["--official-dir", "/nonexistent/official"], "no such directory"),
    (["--official-dir", "EMPTY"], "no model.py"),
])
def test_bad_official_dir(tmp_path, args, msg):
    args = [str(tmp_path) if a == "EMPTY" else a for a in args]
    r = CliRunner().invoke(app, ["verify", "--against", "official", *args])
    assert r.exit_code == 2 and msg in r.output, r.output


def test_known_files_need_cuda(tmp_path, monkeypatch):
    """The files pass; this machine has no CUDA: one line, exit 2, nothing run."""
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    d = _files(tmp_path)
    _fake_releases(monkeypatch, d)
    r = CliRunner().invoke(app, ["verify", "--against", "official", "--official-dir", str(d)])
    assert r.exit_code == 2 and "CUDA" in r.output, r.output


@pytest.mark.parametrize("rev", ["60d8d707", "efc85512"])
def test_the_real_files_when_present(rev):
    """Where DeepSeek's files are in tools/official/release/<rev>/ (git-ignored; tools/official/README.md says
    where to get them), their digests name that release."""
    d = os.path.join(RELEASE_DIR, rev)
    if not os.path.isdir(d):
        pytest.skip(f"no {d}")
    assert official.identify(d)[0].short == rev


def test_judge_limits_and_nan():
    res = official.OfficialResult("60d8d707", {}, "torch", "tiny", 5, 1, "stand-in", rows=[
        {"layer": 0, "kind": "swa", "attn_prefill": 0.004, "block_prefill": 0.009, "moe_decode": 0.0},
        {"layer": 1, "kind": "csa", "attn_prefill": 0.0051, "entries_prefill": float("nan")},
    ], logits={"prefill": 1e-4})
    official.judge(res)
    assert not res.passed
    assert res.failures == ["layer 1 attn prefill 0.510 % > 0.5 %", "layer 1 entries prefill nan % > 0.5 %"]
    assert res.worst["attn"] == [0.0051, "layer 1 prefill"] and res.worst["block"] == [0.009, "layer 0 prefill"]
    assert official.rel(torch.tensor([float("nan")]), torch.tensor([1.0])) == float("inf")
    assert official.rel(torch.tensor([[1.0, 2.0]]), torch.tensor([1.0, 2.0])) == 0.0
    line = res.line()
    assert line.startswith("FAIL") and "official@60d8d707" in line and "stand-in" in line
    ok = official.OfficialResult("efc85512", {}, "triton", "tiny", 5, 0, "h", rows=[{"layer": 0, "kind": "hca",
                                 "attn_prefill": 0.001}], logits={"prefill": 0.0})
    official.judge(ok)
    assert ok.passed and ok.line().startswith("PASS") and json.dumps(ok.to_dict())


def test_sylvester_stand_in_is_the_hadamard_transform():
    """fast_hadamard_transform's contract: H_n x (unnormalised Sylvester order) times scale, in x's dtype."""
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    y = official.sylvester_hadamard(x, 64 ** -0.5)
    h = torch.tensor([[(-1) ** bin(i & j).count("1") for j in range(64)] for i in range(64)], dtype=torch.float32)
    assert torch.allclose(y, x @ h * 64 ** -0.5, atol=1e-5)
    assert torch.allclose(official.sylvester_hadamard(y, 64 ** -0.5), x, atol=1e-5)  # orthonormal: its own inverse


def test_quirks_name_each_release():
    for rev in numerics.OFFICIAL_RELEASES:
        assert official.quirks(rev)
    assert "e4m3" in official.quirks("60d8d707")[0] and "unchanged" in official.quirks("efc85512")[0]


@pytest.mark.gpu
@pytest.mark.tilelang_gpu
@pytest.mark.parametrize("rev", ["60d8d707", "efc85512"])
def test_gpu_verify_against_official(rev):
    """On a GPU with TileLang and DeepSeek's files in tools/official/release/<rev>/: the verdict passes on the
    torch backend (the default numerics of each release against that release's code)."""
    d = os.path.join(RELEASE_DIR, rev)
    if not torch.cuda.is_available() or not os.path.isdir(d):
        pytest.skip("needs CUDA and tools/official/release/" + rev)
    pytest.importorskip("tilelang")
    r = CliRunner().invoke(app, ["verify", "--against", "official", "--official-dir", d, "--backend", "torch",
                                 "--steps", "3", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output.strip().splitlines()[-1])
    assert out["passed"] and out["release"] == rev and out["rows"]


@pytest.mark.slow
@pytest.mark.parametrize("rev", ["60d8d707", "efc85512"])
def test_model_py_runs_on_our_inputs_on_cpu(rev, tiny_dir):
    """The comparison's plumbing on a CPU, where DeepSeek's files are present: the release's own model.py with a
    plain-PyTorch stand-in for its TileLang kernel.py (tests/official_kernel_torch.py), each module on our dump's
    inputs. Our numerics of the release match its model.py in every prefill cell and the logits (both releases: the
    KV form and the shared expert's clamp), and every decode cell within the verdict's limits; ours with the other
    release's KV form is off by what the issue measured on a GPU (attention 3.5-4 %, kv and entries ~2 %).

    Decode cells are held to the verdict's limits, not to 1e-4: on a CPU, bf16 official numerics are not stable
    under the summation order of torch's threaded reductions (a one-ulp move flips an FP8 activation code, or an
    indexer pick at a near-tie). On a 2-core AMD EPYC (2026-12-07) our own tiny logits moved 0.8-2.6 % between 1
    and 2 threads, and the efc85512 layer-3 decode attention against model.py was 0.31 % with 2 threads and 0 with
    1; the 2026-12-05 machine had every cell at 0."""
    d = os.path.join(RELEASE_DIR, rev)
    if not os.path.isdir(d):
        pytest.skip(f"no {d}")
    import official_kernel_torch

    from deepinfer.engine.loader import load_model

    kernel = official_kernel_torch.for_release(rev)
    lm = load_model(None, f"official@{rev}", "bfloat16", "cpu", progress=False)
    ids = lm.tokenizer.encode_prompt("北京是中国的首都，上海是中国最大的城市", "raw")
    res = official.verify_official(lm, d, ids, 3, "torch", kernel=kernel)
    assert {r["kind"] for r in res.rows} == {"swa", "csa", "hca"}
    assert {"attn", "kv", "entries", "index_keys", "moe", "block", "logits"} <= set(res.worst)
    prefill = [v for r in res.rows for k, v in r.items() if k.endswith("_prefill")]
    assert res.passed and max(prefill) < 1e-4 and res.logits["prefill"] < 1e-4, res.line()
    other = load_model(None, f"official@{rev}", "bfloat16", "cpu", progress=False,
                       kv="bf16" if rev == "60d8d707" else "fp8").model
    lm.model = other
    bad = official.verify_official(lm, d, ids, 3, "torch", kernel=kernel)
    assert not bad.passed
    assert all(r["kv_prefill"] > 1e-2 and r["attn_prefill"] > 2e-2 for r in bad.rows), bad.rows
    assert all(r["moe_prefill"] < 1e-4 for r in bad.rows)
