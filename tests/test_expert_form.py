"""A built model's routed experts held as per-128 FP8 for a block (`deepinfer.engine.expert_form`), and the bench
entries that time that form beside the release's (`--against triton:experts=fp8,policy=fast`)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.config import tiny_config
from deepinfer.engine.expert_form import _stacks, fp8_bytes, held_as
from deepinfer.engine.random_weights import random_state
from deepinfer.model.transformer import Transformer
from deepinfer.model.weights import Numerics
from deepinfer.ops import ops


@pytest.fixture(autouse=True)
def _torch_backend():
    before = (ops.backend, ops.strict, dict(ops.op_map))
    ops.configure("torch")
    yield
    ops.configure(*before)


def _model(state=None):
    cfg = tiny_config()
    state = state if state is not None else random_state(cfg, torch.device("cpu"), 0)
    return cfg, Transformer(cfg, state, Numerics("official", torch.float32), "cpu")


def _expert_rows(model, seed=1):
    """Rows of the first layer's routed experts over every expert (fresh random inputs, a padding row)."""
    ex = model.layers[0].ffn.experts
    g = torch.Generator().manual_seed(seed)
    P = 3 * len(ex)
    x = torch.randn(P, model.cfg.dim, generator=g)
    w = torch.rand(P, generator=g)
    e = torch.arange(P) % len(ex)
    e[5] = -1
    return ex, x, w, e


def test_held_as_fp8_swaps_every_stack_and_puts_the_fp4_ones_back():
    cfg, model = _model()
    before = [(st, st.weight, st.scale, st.fmt) for _, st in _stacks(model)]
    assert before and all(f == "fp4" for *_, f in before)
    n_blocks = cfg.n_layers + cfg.n_mtp_layers
    assert len(before) == n_blocks * len({n.rsplit(".", 1)[1] for n, _ in _stacks(model)})
    need = fp8_bytes(model)
    assert need == sum(2 * w.numel() + w.size(0) * -(-w.size(1) // 128) * (2 * w.size(2) // 128) * 4
                       for _, w, _, _ in before)
    with held_as(model, "fp8") as reports:
        assert len(reports) == len(before) and all(r.lossless for r in reports)
        for st, w, s, _ in before:
            assert st.fmt == "fp8" and st.weight.dtype == torch.float8_e4m3fn
            assert st.weight.shape == (w.size(0), w.size(1), 2 * w.size(2)) and st.scale.dtype == torch.float32
    for st, w, s, f in before:  # the same tensors, not copies
        assert st.weight is w and st.scale is s and st.fmt == f == "fp4"
    assert fp8_bytes(model) == need


def test_held_as_fp8_computes_with_the_fp8_weights_and_restores_on_an_error(capsys):
    """Lossless requantisation gives the FP4 path's numbers exactly (fp32 reference); a weight made lossy on
    purpose (one group scale 2^-20 of its block's largest) changes them inside the block only, and is said."""
    cfg = tiny_config()
    state = random_state(cfg, torch.device("cpu"), 0)
    _, model = _model(state)
    ex, x, w, e = _expert_rows(model)
    ref = ex(x, w, e)
    with held_as(model, "fp8"):
        torch.testing.assert_close(ex(x, w, e), ref, rtol=0, atol=0)
    # expert 0's w2: its second 32-group of every row 2^-20 of the rest -> not exact in e4m3 after the block rescale
    st = ex.w2
    sc = st.scale.clone()
    st.scale[0, :, 1] = st.scale[0, :, 0] - 20  # ue8m0 bytes: the exponent minus 20
    lossy_ref = ex(x, w, e)
    with pytest.raises(RuntimeError, match="boom"):
        with held_as(model, "fp8") as reports:
            assert sum(not r.lossless for r in reports) == 1
            err = capsys.readouterr().err  # said, never silent
            assert "experts=fp8 changed values in 1 of" in err and "experts.w2" in err, err
            got = ex(x, w, e)
            assert not torch.equal(got, lossy_ref)
            assert torch.isfinite(got).all()
            raise RuntimeError("boom")
    assert st.fmt == "fp4" and torch.equal(ex(x, w, e), lossy_ref)  # put back, also on the error
    st.scale.copy_(sc)


def test_held_as_fp4_changes_nothing_and_a_bad_form_is_named():
    _, model = _model()
    before = [(st.weight, st.scale) for _, st in _stacks(model)]
    with held_as(model, "fp4") as reports:
        assert reports == []
        assert [(st.weight, st.scale) for _, st in _stacks(model)] == before
    with pytest.raises(ValueError, match="experts=fp16: choose fp4 or fp8"):
        with held_as(model, "fp16"):
            pass


def test_against_entry_takes_the_experts_form():
    from deepinfer.bench.run import parse_against

    backend, op_map, values = parse_against("torch:experts=fp8,policy=fast")
    assert backend == "torch" and op_map == {} and values == {"experts": "fp8", "DEEPINFER_POLICY": "fast"}
    with pytest.raises(ValueError, match=r"'experts=bf16': choose experts=fp4\|fp8"):
        parse_against("torch:experts=bf16")


def test_bench_entry_with_fp8_experts_reports_its_requantisation_and_drift(monkeypatch):
    """One bench run: the main rows on FP4 experts, an entry on FP8 ones (its requantisation summarised, its
    drift from the main logits 0 with exact fp32 sums), and the main model's FP4 stacks intact afterwards."""
    from deepinfer.bench.run import BenchOptions, run_bench

    monkeypatch.delenv("DEEPINFER_POLICY", raising=False)
    r = run_bench(BenchOptions(preset="tiny", batches=(1,), prompt_len=8, gen_len=2, backend="torch",
                               dtype="float32", against=("torch:experts=fp8",)))
    (a,) = r["against"]
    assert a["experts"] == "fp8" and a["settings"] == {}
    assert a["requant"]["stacks"] > 0 and a["requant"]["lossy_stacks"] == 0
    assert a["drift"]["rel_err"] == 0.0 and a["drift"]["top1_agree"] == 1.0
    assert "experts" not in r  # the main configuration is the release's form


def test_bench_refuses_fp8_experts_that_cannot_fit_before_timing(monkeypatch):
    from deepinfer.bench import run as bench_run
    from deepinfer.engine import expert_form, memory

    monkeypatch.setattr(expert_form, "fp8_bytes", lambda model: 1 << 50)
    timed = []
    monkeypatch.setattr(bench_run, "time_prefill", lambda *a, **k: timed.append(1))
    with pytest.raises(memory.MemoryRefused, match=r"--against torch:experts=fp8: the experts' per-128 FP8 form "
                                                   r"needs 1048576\.0 GiB beside the FP4 one, with .* of caches, but "
                                                   r".* is available on cpu"):
        bench_run.run_bench(bench_run.BenchOptions(preset="tiny", batches=(1,), prompt_len=8, gen_len=2,
                                                   backend="torch", dtype="float32",
                                                   against=("torch:experts=fp8",)))
    assert timed == []


def test_build_bytes_with_fp8_experts_are_what_the_model_holds():
    """model_build_bytes(experts="fp8"), counted independently: the requantised state's bytes as loaded and the
    model's FP8 expert stacks as its own copies."""
    from deepinfer.engine import memory
    from deepinfer.engine.loader import build_model
    from deepinfer.quant.requant import requant_experts

    cfg = tiny_config()
    state = random_state(cfg, torch.device("cpu"), 0)
    assert all(r.lossless for r in requant_experts(state))
    loaded, own = memory.model_build_bytes(cfg, True, torch.bfloat16, "fp8")
    assert loaded == sum(t.numel() * t.element_size() for t in state.values())
    model = build_model(cfg, state, Numerics("official", torch.bfloat16), torch.device("cpu"))
    stacks = [t for _, st in _stacks(model) for t in (st.weight, st.scale)]
    assert all(st.fmt == "fp8" for _, st in _stacks(model))
    assert own == sum(t.numel() * t.element_size() for t in stacks)
    l4, o4 = memory.model_build_bytes(cfg, True, torch.bfloat16)
    assert loaded > l4 and own > o4


def test_generate_with_fp8_experts(tiny_dir, monkeypatch):
    """`generate --experts fp8`: the tiny model's tokens as with FP4 experts (lossless requantisation, the torch
    reference); a bad form is one line, exit 2; the up-front memory refusal counts the FP8 form."""
    import json

    from typer.testing import CliRunner

    from deepinfer.engine import memory
    from deepinfer_cli.app import app

    runner = CliRunner()
    args = ["generate", "北京是中国的", "-n", "6", "--json", "--device", "cpu"]
    a = runner.invoke(app, args)
    b = runner.invoke(app, args + ["--experts", "fp8"])
    assert a.exit_code == 0 and b.exit_code == 0, (a.output, b.output)
    ta, tb = (json.loads(r.stdout.strip().splitlines()[-1]) for r in (a, b))
    assert ta["token_ids"] == tb["token_ids"] and ta["logprobs"] == tb["logprobs"]
    r = runner.invoke(app, args + ["--experts", "fp16"])
    assert r.exit_code == 2 and r.output.strip() == "error: --experts fp16: choose fp4 or fp8", r.output
    monkeypatch.setattr(memory, "available_bytes", lambda device="cpu": 1 << 20)
    r = runner.invoke(app, args + ["--experts", "fp8"])
    assert r.exit_code == 2 and "with experts=fp8 needs about" in r.output, r.output


def test_bench_prints_the_requantisation_of_an_fp8_entry():
    from typer.testing import CliRunner

    from deepinfer_cli.app import app

    r = CliRunner().invoke(app, ["bench", "--batch", "1", "--prompt-len", "8", "--gen-len", "2", "--device", "cpu",
                                 "--against", "torch:experts=fp8"])
    assert r.exit_code == 0, r.output
    line = [ln for ln in r.output.splitlines() if ln.startswith("torch:experts=fp8: routed experts requantised")]
    assert len(line) == 1 and "0 lossy" in line[0] and "within 2^" in line[0], r.output


def test_fp8_experts_need_official_numerics(tiny_dir):
    """Exact numerics hold the experts dequantised: experts=fp8 has nothing to requantise and is refused, at load
    and as a bench entry, before any timing."""
    from deepinfer.bench.run import BenchOptions, run_bench
    from deepinfer.engine.loader import OptionError, load_model

    with pytest.raises(OptionError, match="experts=fp8 with exact numerics"):
        load_model(None, numerics="exact", dtype="float32", device="cpu", progress=False, experts="fp8")
    with pytest.raises(OptionError, match="holds no FP4 routed experts"):
        run_bench(BenchOptions(preset="tiny", batches=(1,), prompt_len=8, gen_len=2, backend="torch",
                               numerics="exact", dtype="float32", against=("torch:experts=fp8",)))


def test_the_memory_check_counts_deepgemms_own_fp8_copies(monkeypatch):
    """An entry sending grouped_gemm to DeepGEMM leaves DeepGEMM's per-128 FP8 copy of every expert stack held for
    the rest of the process: an experts=fp8 entry that fits alone is refused beside it, with the doubled need."""
    from deepinfer.bench import run as bench_run
    from deepinfer.engine import expert_form, memory

    cfg, model = _model()
    opts = bench_run.BenchOptions(preset="tiny", batches=(1,), prompt_len=8, gen_len=2)
    need = 1 << 30
    caches = memory.cache_bytes(cfg, 2, 8 + 40, torch.float32, True)
    monkeypatch.setattr(expert_form, "fp8_bytes", lambda m: need)
    monkeypatch.setattr(memory, "available_bytes", lambda device="cpu": int((1.5 * need + caches) / 0.9))
    fp8 = ("torch:experts=fp8", "torch", {}, {"experts": "fp8"})
    num = Numerics("official", torch.float32)
    bench_run.check_expert_forms(model, cfg, opts, [fp8], num, [1], "cpu")  # fits alone
    for dg in (("deepgemm", "torch", {"grouped_gemm": "deepgemm"}, {}),
               ("torch:grouped_gemm=decode:torch/prefill:deepgemm", "torch",
                {"grouped_gemm": {"decode": "torch", "prefill": "deepgemm"}}, {})):
        with pytest.raises(memory.MemoryRefused, match=r"needs 2\.0 GiB beside the FP4 one"):
            bench_run.check_expert_forms(model, cfg, opts, [dg, fp8], num, [1], "cpu")
    bench_run.check_expert_forms(model, cfg, opts, [("triton", "triton", {}, {}), fp8], num, [1], "cpu")
