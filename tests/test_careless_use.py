"""Careless use, by class (issue 51, a sweep of 2026-12-06): every mistake is one line naming what is wrong and
where, exit 2, before any work; nothing is half-written and no input is overwritten.

Each test was checked to fail with the fix it covers taken out."""

import os
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from deepinfer_cli.app import app

runner = CliRunner()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _one_line(r, code: int = 2) -> str:
    assert r.exit_code == code, r.output
    assert "Traceback" not in r.output and "internal error" not in r.output, r.output
    lines = [ln for ln in r.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.output
    return lines[0]


# ------------------------------------------------------------------ usage errors: one line, not a box
@pytest.mark.parametrize("args, says", [
    (["generate", "x", "-n", "2", "--max-new-tokens", "3"], "--max-new-tokens given more than once"),
    (["generate", "x", "--op", "@m.yaml", "--op=rms_norm=torch"], "--op given more than once"),
    (["margin", "x", "--noise", "--no-noise"], "--noise given more than once"),
    (["show"], "Missing argument"),
    (["probe", "bogus"], "No such command 'bogus'"),
    (["stack", "abc"], "'pids'"),
    (["show", "--bogus", "x"], "No such option: --bogus"),
    (["nonexist"], "No such command 'nonexist'"),
])
def test_usage_errors_are_one_line(args, says):
    line = _one_line(runner.invoke(app, args))
    assert says in line and "--help`" in line


def test_usage_error_in_a_real_process_and_help_still_works():
    env = {**os.environ, "PYTHONPATH": ROOT}
    p = subprocess.run([sys.executable, "-m", "deepinfer", "show"], capture_output=True, text=True, env=env)
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and "Missing argument" in p.stderr, p.stderr
    p = subprocess.run([sys.executable, "-m", "deepinfer", "show", "--help"], capture_output=True, text=True, env=env)
    assert p.returncode == 0 and "Usage" in p.stdout
    p = subprocess.run([sys.executable, "-m", "deepinfer", "--debug", "show"], capture_output=True, text=True,
                       env=env)
    assert p.returncode == 2 and "Usage" in p.stderr  # --debug keeps Click's own block


def test_a_commands_own_bad_parameter_is_bad_input_not_a_bug(tiny_dir):
    assert "a PROMPT argument is required" in _one_line(runner.invoke(app, ["generate", "-n", "1"]))
    assert "--chat and --think are exclusive" in _one_line(
        runner.invoke(app, ["generate", "x", "-n", "1", "--chat", "--think"]))


# ------------------------------------------------------------------ devices this machine does not have
@pytest.mark.parametrize("cmd", [["ab", "--backend", "torch", "--shapes", "tiny"],
                                 ["tune", "-o", "{tmp}/m.yaml", "--shapes", "tiny", "--candidates", "torch",
                                  "--baseline", "torch"]])
@pytest.mark.parametrize("device", ["tpu", "meta", "cuda:7"])
def test_ab_and_tune_refuse_a_missing_device(cmd, device, tmp_path):
    if device.startswith("cuda") and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    args = [a.replace("{tmp}", str(tmp_path)) for a in cmd] + ["--device", device]
    line = _one_line(runner.invoke(app, args))
    assert f"--device {device}" in line or f"--device '{device}'" in line
    assert os.listdir(tmp_path) == []


def test_ab_dump_makes_no_folder_for_a_missing_device(tmp_path):
    _one_line(runner.invoke(app, ["ab", "--backend", "torch", "--device", "cuda:7", "--dump", str(tmp_path / "d")]))
    assert not (tmp_path / "d").exists()


# ------------------------------------------------------------------ steps past the context, refused first
@pytest.mark.parametrize("cmd", [["dump", "北京是", "--steps", "2000000", "-o", "{tmp}/d.h5"],
                                 ["margin", "北京是", "--steps", "2000000"]])
def test_steps_past_the_context_are_refused_before_allocating(cmd, tmp_path, tiny_dir):
    r = runner.invoke(app, [a.replace("{tmp}", str(tmp_path)) for a in cmd])
    line = _one_line(r)
    assert "exceed the model's context of 1048576" in line
    assert os.listdir(tmp_path) == []


def test_allocate_refuses_what_does_not_fit_with_the_numbers(monkeypatch):
    from deepinfer.config import tiny_config
    from deepinfer.engine import memory
    from deepinfer.engine.memory import MemoryRefused, check_allocation

    cfg = tiny_config()
    check_allocation(cfg, 2, 64, torch.float32, False, "cpu")  # small: fine
    monkeypatch.setattr(memory, "available_bytes", lambda device="cpu": 1 << 20)
    with pytest.raises(MemoryRefused, match=r"need .* of caches .* but 1 MiB of memory is available"):
        check_allocation(cfg, 64, 100_000, torch.float32, False, "cpu")
    held = memory.cache_bytes(cfg, 64, 100_000, torch.float32, False)  # an allocation being replaced is given back
    check_allocation(cfg, 64, 100_000, torch.float32, False, "cpu", held)


# ------------------------------------------------------------------ output paths
@pytest.mark.parametrize("cmd", [["dump", "北京是", "--steps", "1", "-o", "{tmp}/newdir/"],
                                 ["tune", "-o", "{tmp}/tdir/", "--shapes", "tiny", "--candidates", "torch",
                                  "--baseline", "torch", "--ops", "rms_norm$"]])
def test_a_path_ending_in_a_separator_is_refused(cmd, tmp_path, tiny_dir):
    r = runner.invoke(app, [a.replace("{tmp}", str(tmp_path)) for a in cmd])
    assert "names a directory; give a file name" in _one_line(r)
    assert os.listdir(tmp_path) == []  # no temp file, no file named like the folder


def test_an_output_that_is_an_input_is_refused(tmp_path, tiny_dir):
    ref = tmp_path / "ref.h5"
    assert runner.invoke(app, ["dump", "北京是", "--steps", "2", "-o", str(ref)]).exit_code == 0
    before = ref.read_bytes()
    r = runner.invoke(app, ["dump", "北京是", "--steps", "1", "-o", str(ref), "--follow", str(ref)])
    assert "is also an input of this command" in _one_line(r)
    assert ref.read_bytes() == before
    r = runner.invoke(app, ["compare", str(ref), str(ref), "--report", str(ref)])
    assert "--report" in _one_line(r) and ref.read_bytes() == before
    r = runner.invoke(app, ["margin", "--from-dumps", str(ref), str(ref), "--plot", str(ref)])
    assert "--plot" in _one_line(r) and ref.read_bytes() == before


def test_an_output_that_would_replace_a_checkpoint_file_is_refused(tmp_path, tiny_dir):
    """`dump -o MODEL/config.json --model MODEL` wrote HDF5 over the checkpoint's config (sweep of 2026-12-08)."""
    import shutil

    model = tmp_path / "m"
    shutil.copytree(tiny_dir, model)
    cfg = (model / "config.json").read_bytes()
    r = runner.invoke(app, ["dump", "北京是", "--steps", "1", "--model", str(model), "-o", str(model / "config.json")])
    assert "would replace a file of" in _one_line(r) and (model / "config.json").read_bytes() == cfg
    link = tmp_path / "cfg-link.json"  # through a symlink too
    link.symlink_to(model / "config.json")
    r = runner.invoke(app, ["dump", "北京是", "--steps", "1", "--model", str(model), "-o", str(link)])
    assert "would replace a file of" in _one_line(r) and (model / "config.json").read_bytes() == cfg
    r = runner.invoke(app, ["dump", "北京是", "--steps", "1", "--model", str(model), "-o", str(model / "new.h5")])
    assert r.exit_code == 0, r.output  # a new file beside the checkpoint replaces nothing


def test_bench_refuses_a_record_file_it_cannot_append_to_before_the_run(tmp_path):
    rec = tmp_path / "rec.h5"
    rec.write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(64))
    r = runner.invoke(app, ["bench", "--preset", "tiny", "--batch", "1", "--prompt-len", "4", "--gen-len", "1",
                            "--device", "cpu", "--record", str(rec)])
    line = _one_line(r)
    assert "--record" in line and "not UTF-8 text (byte 0x89 at offset 0)" in line
    assert "building the model" not in r.output


@pytest.mark.parametrize("args, says", [
    (["--prompt-len", "99999999"], "exceed the model's context of 1048576"),
    (["--prompt-len", "4", "--batch", "1,1000000"], r"--batch 1000000 at --prompt-len 4: the model"),
])
def test_bench_refuses_a_run_that_cannot_fit_before_building(args, says):
    import re

    r = runner.invoke(app, ["bench", "--preset", "tiny", "--gen-len", "1", "--device", "cpu", *args])
    assert re.search(says, _one_line(r)), r.output
    assert "building the model" not in r.output


def test_follow_refuses_a_dump_of_another_prompt(tmp_path, tiny_dir):
    """`dump OTHER --follow ref.h5` teacher-forced another prompt's continuation (sweep of 2026-12-08); `compare`
    would then refuse the pair. The prompt, its layout and the model config must match the followed dump's."""
    ref = tmp_path / "ref.h5"
    assert runner.invoke(app, ["dump", "北京是", "--steps", "2", "-o", str(ref)]).exit_code == 0
    r = runner.invoke(app, ["dump", "上海是", "--steps", "2", "--follow", str(ref), "-o", str(tmp_path / "t.h5")])
    assert "its prompt is '北京是', this run's is '上海是'" in _one_line(r)
    r = runner.invoke(app, ["dump", "北京是", "--chat", "--steps", "2", "--follow", str(ref), "-o", str(tmp_path / "t.h5")])
    assert "its prompt layout is raw, this run's is chat" in _one_line(r)
    assert sorted(os.listdir(tmp_path)) == ["ref.h5"]
    r = runner.invoke(app, ["dump", "北京是", "--steps", "2", "--follow", str(ref), "-o", str(tmp_path / "t.h5")])
    assert r.exit_code == 0, r.output


def test_margin_refuses_a_prompt_beside_dumps(tmp_path, tiny_dir):
    ref = tmp_path / "ref.h5"
    assert runner.invoke(app, ["dump", "北京是", "--steps", "1", "-o", str(ref)]).exit_code == 0
    r = runner.invoke(app, ["margin", "北京是", "--from-dumps", str(ref), str(ref)])
    assert "--from-dumps" in _one_line(r)
    # options the dumps already fix were ignored (sweep of 2026-12-08)
    for extra, name in ((["--steps", "5"], "--steps"), (["--ref", "numerics=exact"], "--ref"),
                        (["--test", "dtype=float32"], "--test"), (["--no-noise"], "--no-noise"), (["--chat"], "--chat"),
                        (["--model", "preset:tiny"], "--model")):
        r = runner.invoke(app, ["margin", "--from-dumps", str(ref), str(ref), *extra])
        assert f"{name} with --from-dumps" in _one_line(r)
    assert runner.invoke(app, ["margin", "--from-dumps", str(ref), str(ref), "--json"]).exit_code == 0


# ------------------------------------------------------------------ values and files
def test_option_values(tmp_path):
    assert "--rtol -1: must be >= 0" in _one_line(runner.invoke(app, ["dist-check", "x", "--rtol", "-1"]))
    assert "--timeout -5: must be > 0" in _one_line(runner.invoke(app, ["stack", "--timeout", "-5", "1"]))
    m = tmp_path / "m.yaml"
    from deepinfer.debug.tune import tune, write_map

    write_map(str(m), tune("torch", ["torch"], "rms_norm$", "tiny", 0, "cpu"))
    m.write_text(m.read_text().replace("rms_norm: torch", "rms_norm: 5"))
    line = _one_line(runner.invoke(app, ["generate", "x", "-n", "1", "--op", f"@{m}"]))
    assert "rms_norm: 5 is not a backend" in line


def test_text_that_is_not_utf8_names_its_source(tmp_path, tiny_dir):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"abc\xff\xfe\x80def\n")
    line = _one_line(runner.invoke(app, ["generate", "--input-file", str(bad), "-n", "1"]))
    assert f"--input-file {bad}: not UTF-8 text (byte 0xff at offset 3)" in line
    line = _one_line(runner.invoke(app, ["generate", "-", "-n", "1"], input=b"abc\xff\xfe def"))
    assert "PROMPT - (stdin): not UTF-8 text (byte 0xff at offset 3)" in line
    ref = tmp_path / "ref.h5"
    assert runner.invoke(app, ["dump", "北京是", "--steps", "1", "-o", str(ref)]).exit_code == 0
    line = _one_line(runner.invoke(app, ["compare", str(ref), str(ref), "--tolerances", str(bad)]))
    assert f"--tolerances {bad}: not UTF-8 text" in line


def test_ab_compare_with_a_file_that_is_not_a_case_is_bad_input(tmp_path):
    d = tmp_path / "cases"
    d.mkdir()
    (d / "case1.h5").write_text("not hdf5")
    line = _one_line(runner.invoke(app, ["ab", "--backend", "torch", "--compare", str(d)]))
    assert "1 of 1 .h5 files are not `ab --dump` case files: case1.h5" in line


@pytest.mark.parametrize("home, says", [("{tmp}/file.txt", "Not a directory"),
                                        ("/proc/deepinfer-home", "cannot create")])
def test_a_bad_deepinfer_home_is_named(home, says, tmp_path, monkeypatch):
    (tmp_path / "file.txt").write_text("x")
    monkeypatch.setenv("DEEPINFER_HOME", home.replace("{tmp}", str(tmp_path)))
    line = _one_line(runner.invoke(app, ["generate", "x", "-n", "1"]))
    assert line.startswith("error: DEEPINFER_HOME:") and says in line


def test_a_directory_or_a_file_where_the_other_is_meant(tmp_path, tiny_dir):
    assert "is a directory, not a dump file" in _one_line(runner.invoke(app, ["show", str(tmp_path)]))
    f = tmp_path / "model.txt"
    f.write_text("x")
    assert f"--model {f}: is a file" in _one_line(runner.invoke(app, ["generate", "x", "--model", str(f)]))


@pytest.mark.parametrize("cmd", ["margin", "bisect"])
@pytest.mark.parametrize("opt, spec, says", [("--test", "device=cuda:7", "--test device=cuda:7: "),
                                             ("--ref", "backend=nope", "--ref backend=nope: unknown backend 'nope'"),
                                             ("--test", "dtype=int8", "--test 'dtype=int8': dtype=int8: choose one of")])
def test_a_spec_error_names_its_option(cmd, opt, spec, says, tiny_dir):
    if "cuda" in spec and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    line = _one_line(runner.invoke(app, [cmd, "北京是", opt, spec, "--steps", "1"]))
    assert says in line and "--device cuda" not in line


def test_a_bad_preset_is_refused_before_the_first_progress_line():
    line = _one_line(runner.invoke(app, ["bench", "--preset", "bogus", "--device", "cpu"]))
    assert "--preset 'bogus'" in line


def test_a_crlf_prompt_on_stdin_reads_as_text_mode_did(monkeypatch):
    import io

    from deepinfer_cli.common import read_prompt

    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO("北京\r\n是\r\n".encode())))
    assert read_prompt("-") == "北京\n是"


def test_verify_makes_no_folder_for_a_missing_device(tmp_path, tiny_dir):
    pytest.importorskip("transformers")
    line = _one_line(runner.invoke(app, ["verify", "--out-dir", str(tmp_path / "v"), "--device", "cuda:7"]))
    assert "cuda:7" in line and not (tmp_path / "v").exists()


def test_a_backend_from_the_environment_is_named_as_such(monkeypatch, tiny_dir):
    """DEEPINFER_BACKEND=triton on a CPU was refused as `--backend triton`, an option the user never gave (sweep of
    2026-12-08); DEEPINFER_OPS likewise."""
    from deepinfer import settings

    # imported first, interpreted as the session is: its module-level INTERPRET must not see the patch below
    pytest.importorskip("deepinfer_kernels.triton")
    monkeypatch.setattr(settings, "triton_interpreted", lambda: False)
    monkeypatch.setenv("DEEPINFER_BACKEND", "triton")
    line = _one_line(runner.invoke(app, ["generate", "x", "-n", "1", "--device", "cpu"]))
    assert line.startswith("error: DEEPINFER_BACKEND triton needs a CUDA device"), line
    line = _one_line(runner.invoke(app, ["generate", "x", "-n", "1", "--device", "cpu", "--backend", "triton"]))
    assert line.startswith("error: --backend triton needs a CUDA device"), line
    monkeypatch.delenv("DEEPINFER_BACKEND")
    monkeypatch.setenv("DEEPINFER_OPS", "rms_norm=triton")
    line = _one_line(runner.invoke(app, ["generate", "x", "-n", "1", "--device", "cpu"]))
    assert line.startswith("error: DEEPINFER_OPS backend triton needs a CUDA device"), line


def test_kernel_settings_on_the_cpu_reference_are_said_to_change_nothing(monkeypatch, tiny_dir):
    """DEEPINFER_FP8_GEMM=cublas or DEEPINFER_POLICY=fast with generate on a CPU were unused in silence (sweep of
    2026-12-08): one stderr line names them; a setting at its default is not named."""
    monkeypatch.setenv("DEEPINFER_FP8_GEMM", "cublas")
    monkeypatch.setenv("DEEPINFER_POLICY", "fast")
    monkeypatch.setenv("DEEPINFER_PDL", "1")
    r = runner.invoke(app, ["generate", "北京是", "-n", "1", "--device", "cpu", "--backend", "torch", "--json"])
    assert r.exit_code == 0, r.output
    assert ("deepinfer: DEEPINFER_POLICY=fast, DEEPINFER_FP8_GEMM=cublas: kernel settings; this run is the torch "
            "reference on a CPU, where they change nothing") in r.stderr
    assert "DEEPINFER_PDL" not in r.stderr
