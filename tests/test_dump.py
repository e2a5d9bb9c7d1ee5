"""deepinfer dump / show: HDF5 round trip of every dtype, atomic writes, the dumper on deepinfer-tiny."""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from deepinfer import capture
from deepinfer.debug.dumper import parse_layers, run_dump, save
from deepinfer.debug.fingerprint import environment, run_fingerprint
from deepinfer.debug.h5schema import (
    DumpError,
    DumpReader,
    DumpWriter,
    read_dump,
    write_dump,
)
from deepinfer.engine.loader import load_model
from deepinfer_cli.app import app

PROMPT_IDS = [0, 5, 17, 300, 4242, 99, 7, 1234, 8, 77]  # 10 tokens: crosses the window (8), 2 CSA entries


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        ib = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.view(ib), b.view(ib))
    return torch.equal(a, b)


def test_every_dtype_round_trips_bit_exactly(tmp_path):
    special = torch.tensor([0.0, -0.0, 1.0, -2.5, 1e-40, 3e38, float("inf"), float("-inf"), float("nan")])
    tensors = {
        "bf16": torch.cat([special, torch.randn(100)]).to(torch.bfloat16).view(-1, 1),
        "fp8": torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).view(16, 16),  # every bit pattern
        "fp8_e5m2": torch.arange(256, dtype=torch.uint8).view(torch.float8_e5m2),
        "f32": torch.cat([special, torch.randn(50)]),
        "f16": torch.randn(3, 4).half(),
        "f64": torch.randn(5, dtype=torch.float64),
        "i64": torch.tensor([[-1, 0, 2**62], [3, -2**63, 7]]),
        "i32": torch.tensor([-(2**31), 2**31 - 1, 0], dtype=torch.int32),
        "u8": torch.tensor([0, 255], dtype=torch.uint8),
        "bool": torch.tensor([True, False]),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 128, dtype=torch.bfloat16),
    }
    p = tmp_path / "rt.h5"
    write_dump(p, tensors, {"prompt": "北京是", "seed": 3, "flag": True, "none": None})
    attrs, back = read_dump(p)
    assert list(back) == list(tensors)  # capture order preserved
    for n, t in tensors.items():
        assert _same_bits(back[n], t), n
    assert attrs["prompt"] == "北京是" and attrs["seed"] == 3 and attrs["flag"] and attrs["none"] == ""
    with h5py.File(p) as f:  # the documented storage: raw bits + dtype attribute, chunked + gzip
        assert f["tensors/bf16"].dtype == np.uint16 and f["tensors/bf16"].attrs["dtype"] == "bfloat16"
        assert f["tensors/fp8"].dtype == np.uint8 and f["tensors/fp8"].attrs["dtype"] == "float8_e4m3fn"
        assert f["tensors/f32"].compression == "gzip" and f["tensors/f32"].chunks is not None
        assert f.attrs["format"] == "deepinfer-dump"


def test_atomic_write_leaves_nothing_on_failure(tmp_path):
    p = tmp_path / "x.h5"
    with pytest.raises(RuntimeError):
        with DumpWriter(p, {"a": 1}) as w:
            w.add("t", torch.ones(4))
            raise RuntimeError("crash mid-write")
    assert not p.exists() and os.listdir(tmp_path) == []
    # an existing file at the target survives a failed rewrite untouched
    write_dump(p, {"old": torch.zeros(2)})
    with pytest.raises(KeyboardInterrupt):
        with DumpWriter(p) as w:
            w.add("new", torch.ones(2))
            raise KeyboardInterrupt
    assert list(read_dump(p)[1]) == ["old"] and os.listdir(tmp_path) == ["x.h5"]
    # a bad attribute fails in __enter__, which must clean up as well
    with pytest.raises(TypeError):
        with DumpWriter(tmp_path / "y.h5", {"bad": object.__new__(type("X", (), {"__str__": None}))}):
            pass
    assert os.listdir(tmp_path) == ["x.h5"]


def test_writer_rejects_bad_names(tmp_path):
    with pytest.raises(RuntimeError):
        with DumpWriter(tmp_path / "n.h5") as w:
            w.add("a", torch.ones(1))
            with pytest.raises(ValueError):
                w.add("a", torch.ones(1))
            with pytest.raises(ValueError):
                w.add("a/b", torch.ones(1))
            raise RuntimeError
    assert not (tmp_path / "n.h5").exists()


def test_reader_errors(tmp_path):
    with pytest.raises(DumpError, match="no such file"):
        DumpReader(tmp_path / "missing.h5")
    (tmp_path / "t.h5").write_text("not hdf5")
    with pytest.raises(DumpError, match="not a readable HDF5"):
        DumpReader(tmp_path / "t.h5")
    with h5py.File(tmp_path / "o.h5", "w") as f:
        f["x"] = np.zeros(3)
    with pytest.raises(DumpError, match="not a deepinfer dump"):
        DumpReader(tmp_path / "o.h5")


def test_parse_layers():
    assert parse_layers([], None, 4) is None
    assert parse_layers([], "all", 4) is None
    assert parse_layers([2], "0-1", 4) == [0, 1, 2]
    assert parse_layers([], "3,1", 4) == [1, 3]
    for bad in ("5", "2-1", "x"):
        with pytest.raises(ValueError):
            parse_layers([], bad, 4)


def test_fingerprint_fields():
    env = environment("cpu")
    for k in ("deepinfer_version", "git_revision", "device_name", "torch_version", "triton_version",
              "triton_is_flagtree", "tilelang_version", "flag_gems_version", "hostname"):
        assert k in env
    assert isinstance(env["triton_is_flagtree"], bool)
    import sys
    assert "tilelang" not in sys.modules and "flag_gems" not in sys.modules  # metadata only


@pytest.fixture(scope="module")
def tiny():
    return load_model(None, "exact", "float32", "cpu", progress=False)


def test_dumper_names_shapes_and_steps(tiny):
    cfg, T = tiny.cfg, len(PROMPT_IDS)
    run = run_dump(tiny.model, PROMPT_IDS, steps=2)
    rec = dict(run.records)
    assert not capture.is_active()
    assert torch.equal(rec["input_ids"], torch.tensor(PROMPT_IDS))
    assert rec["logits"].shape == (T, cfg.vocab_size) and rec["logits"].dtype == torch.float32
    assert rec["step2.logits"].shape == (1, cfg.vocab_size)
    assert len(run.tokens) == 3 and run.tokens[0] == int(rec["logits"][-1].argmax())
    assert int(rec["step1.input_ids"][0]) == run.tokens[0] and int(rec["step2.input_ids"][0]) == run.tokens[1]
    for i in range(cfg.n_layers):
        for tap in ("hc_attn.in", "hc_attn.post", "hc_attn.comb", "attn.in", "attn.q", "attn.kv", "attn.core",
                    "attn.out", "hc_attn.out", "ffn.in", "ffn.router.scores", "ffn.router.experts",
                    "ffn.router.weights", "ffn.out", "hc_ffn.out"):
            assert f"layers.{i}.{tap}" in rec and f"step1.layers.{i}.{tap}" in rec
    # layer 1 is CSA: compressed kv and the indexer; token axis first everywhere
    assert rec["layers.1.attn.compressed_kv"].shape == (T // 4, cfg.head_dim)
    assert rec["layers.1.attn.indexer.topk"].shape[0] == T
    assert rec["layers.0.attn.q"].shape == (T, cfg.n_heads, cfg.head_dim)
    assert rec["layers.0.ffn.router.experts"].shape == (T, cfg.n_activated_experts)
    # capture copies: the recorded cache-derived tensors are not views of live buffers
    assert all(t.untyped_storage().data_ptr() != tiny.model.layers[0].attn.kv_cache.untyped_storage().data_ptr()
               for _, t in run.records)


def test_dumper_layer_selection_and_forcing(tiny):
    run = run_dump(tiny.model, PROMPT_IDS, steps=2, layers=[2], force_tokens=[11, 12])
    names = [n for n, _ in run.records]
    assert {"input_ids", "logits", "step1.logits", "step2.input_ids"} <= set(names)
    assert all(n.split(".")[0] != "layers" or n.startswith("layers.2.") for n in names)
    assert any(n.startswith("step2.layers.2.") for n in names) and not any("layers.1." in n for n in names)
    assert run.tokens[:2] == [11, 12]


def test_dump_and_show_cli(tmp_path, tiny):
    out = tmp_path / "d.h5"
    r = CliRunner().invoke(app, ["dump", "北京是", "--layers", "0-1", "--steps", "1", "--numerics", "exact",
                                 "--dtype", "float32", "--device", "cpu", "--out", str(out)])
    assert r.exit_code == 0, r.output
    with DumpReader(out) as d:
        assert d.attrs["numerics"] == "exact" and d.attrs["backend"] == "torch"
        assert d.attrs["config_fingerprint"] == tiny.cfg.fingerprint() and d.attrs["prompt"] == "北京是"
        assert "layers.1.attn.indexer.topk" in d and "layers.2.attn.q" not in d and "generated_ids" in d
        assert [d.meta(n)["order"] for n in d.names()] == sorted(d.meta(n)["order"] for n in d.names())
    r = CliRunner().invoke(app, ["show", str(out), "--filter", r"^layers\.0\."])
    assert r.exit_code == 0 and "hc_attn.comb" in r.output and "config_fingerprint" in r.output
    r = CliRunner().invoke(app, ["show", str(tmp_path / "nope.h5")])
    assert r.exit_code == 2


def test_save_writes_generated_ids(tmp_path, tiny):
    run = run_dump(tiny.model, PROMPT_IDS[:3], steps=1, layers=[0])
    attrs = run_fingerprint(device="cpu", backend="torch", numerics="exact", dtype="float32", model_path="",
                            model_name="t", config_fingerprint=tiny.cfg.fingerprint(), prompt="p", seed=0)
    save(run, tmp_path / "s.h5", attrs)
    _, t = read_dump(tmp_path / "s.h5")
    assert t["generated_ids"].tolist() == run.tokens
    assert t["layers.0.attn.compressed_kv"].shape[0] == 0 if "layers.0.attn.compressed_kv" in t else True


@pytest.mark.parametrize("numerics,name", [("official", "official@60d8d707"), (None, "official@60d8d707"),
                                           ("official@efc85512", "official@efc85512")])
def test_dump_fingerprint_names_the_release(tmp_path, tiny, numerics, name):
    """The default numerics are release 60d8d707's, and the dump says so (a dump of the initial release's
    numerics names that one): two dumps of different releases never pass for the same settings."""
    out = tmp_path / "d.h5"
    args = ["dump", "北京是", "--layers", "0", "--steps", "0", "--device", "cpu", "--out", str(out)]
    r = CliRunner().invoke(app, args + (["--numerics", numerics] if numerics else []))
    assert r.exit_code == 0, r.output
    with DumpReader(out) as d:
        assert d.attrs["numerics"] == name
