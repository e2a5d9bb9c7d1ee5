"""Checkpoint reader/validator/writer and the generated tiny model (CPU, a few seconds in all)."""

from __future__ import annotations

import filecmp
import json
import os
import pathlib

import pytest
import torch
from safetensors.torch import save_file

from deepinfer.checkpoint import (
    INDEX_NAME,
    CheckpointError,
    load_state,
    mtp_layers_present,
    open_checkpoint,
    validate,
    write_checkpoint,
)
from deepinfer.checkpoint.reader import _check_fits
from deepinfer.config import ConfigError, config_from_dict, load_config, tiny_config
from deepinfer.quant.formats import e8m0_to_float

MINI = tiny_config().replace(vocab_size=512)  # tiny, but a 66 MB embedding is not needed for format tests


@pytest.fixture(scope="module")
def mini_tensors():
    from deepinfer.tiny import tiny_tensors

    return tiny_tensors(MINI)


def _write(path, tensors, **kw):
    return write_checkpoint(str(path), tensors, MINI.to_official_json(), **kw)


def _one_error(fn, *args) -> str:
    with pytest.raises(CheckpointError) as ei:
        fn(*args)
    return str(ei.value)


# --------------------------------------------------------------------------- round trips


def test_mini_round_trip_dtypes_and_scale_decoding(tmp_path, mini_tensors):
    t = dict(mini_tensors)
    t["layers.0.attn.wq_a.scale"] = torch.full_like(t["layers.0.attn.wq_a.scale"], 130)  # byte 130 = 2^3
    d = _write(tmp_path / "m", t, max_shard_bytes=1 << 20)
    ck = open_checkpoint(d)
    assert ck.layout == "official" and len(ck.files) > 1 and mtp_layers_present(ck) == 1
    assert ck.spec("layers.0.attn.wq_a.scale")[0] == "F8_E8M0"  # uint8 bytes were written as F8_E8M0
    validate(ck, MINI)
    st = load_state(ck, MINI, progress=False)
    assert st["layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert torch.equal(st["layers.0.attn.wq_a.weight"].view(torch.uint8), t["layers.0.attn.wq_a.weight"].view(torch.uint8))
    s = st["layers.0.attn.wq_a.scale"]
    assert s.dtype == torch.float32 and torch.all(s == 8.0)  # never 130.0
    w1 = "layers.1.ffn.experts.3.w1"
    assert st[w1 + ".weight"].dtype == torch.int8 and torch.equal(st[w1 + ".weight"], t[w1 + ".weight"])
    assert torch.equal(st[w1 + ".scale"], e8m0_to_float(t[w1 + ".scale"]))
    assert st["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    assert st["embed.weight"].dtype == torch.bfloat16 and st["layers.1.attn.compressor.ape"].dtype == torch.float32
    assert torch.equal(ck.get("norm.weight"), t["norm.weight"])


@pytest.mark.parametrize("scale_dtype", ["U8", "F32"])
def test_raw_u8_and_decoded_f32_scales_single_file(tmp_path, mini_tensors, scale_dtype):
    """A single model.safetensors without index; scales as raw bytes (U8) or already-decoded float32."""
    t = {k: v.contiguous() for k, v in mini_tensors.items()}
    name = "layers.2.ffn.shared_experts.w2.scale"
    raw = torch.full_like(t[name], 130)
    for k in t:
        if k.endswith(".scale"):
            t[k] = e8m0_to_float(t[k]) if scale_dtype == "F32" else t[k]
    t[name] = e8m0_to_float(raw) if scale_dtype == "F32" else raw
    tmp_path.joinpath("m").mkdir()
    save_file(t, str(tmp_path / "m" / "model.safetensors"))
    ck = open_checkpoint(str(tmp_path / "m"))
    assert ck.spec(name)[0] == scale_dtype
    st = load_state(ck, MINI, progress=False)
    assert st[name].dtype == torch.float32 and torch.all(st[name] == 8.0)


def test_hub_mtp_copies_of_embed_and_head_are_ignored(tmp_path, mini_tensors):
    t = dict(mini_tensors)
    t["mtp.0.emb.tok_emb.weight"] = t["embed.weight"].clone()
    t["mtp.0.head.weight"] = t["head.weight"].clone()
    ck = open_checkpoint(_write(tmp_path / "m", t))
    assert set(ck.ignored) == {"mtp.0.emb.tok_emb.weight", "mtp.0.head.weight"}
    validate(ck, MINI)
    assert "mtp.0.head.weight" not in load_state(ck, MINI, progress=False)


# --------------------------------------------------------------------------- transformers layout


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.DeepseekV4Config(
        vocab_size=512, hidden_size=128, moe_intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
        head_dim=128, qk_rope_head_dim=64, q_lora_rank=64, o_groups=2, o_lora_rank=32, num_experts_per_tok=2,
        n_routed_experts=4, index_n_heads=2, index_head_dim=64, index_topk=4, sliding_window=8,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    )
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(cfg)
    with torch.no_grad():  # random everywhere (norms init to 1), so value checks below mean something
        for prm in model.parameters():
            prm.normal_()
    d = tmp_path_factory.mktemp("hf") / "model"
    model.save_pretrained(str(d))
    return d, model.state_dict()


def test_transformers_layout_maps_names_and_validates(hf_dir):
    d, sd = hf_dir
    ck = open_checkpoint(str(d))
    assert ck.layout == "transformers" and mtp_layers_present(ck) == 0
    cfg = config_from_dict(json.loads((d / "config.json").read_text()), n_mtp_layers=0)
    validate(ck, cfg)
    names = set(ck.names())
    assert {"embed.weight", "head.weight", "hc_head_fn", "hc_head_base", "hc_head_scale"} <= names
    assert ck.stored_name("layers.1.attn.kv_norm.weight") == "model.layers.1.attn.norm.weight"
    assert ck.stored_name("layers.1.attn.compressor.norm.weight") == "model.layers.1.attn.compressor.norm.weight"
    assert "layers.1.attn.indexer.compressor.norm.weight" in names
    st = load_state(ck, cfg, progress=False)
    # values land where the official names say (in-memory transformers names differ from the saved ones)
    pairs = {
        "layers.1.attn.kv_norm.weight": sd["model.layers.1.self_attn.kv_norm.weight"],
        "layers.1.attn.compressor.norm.weight": sd["model.layers.1.self_attn.compressor.kv_norm.weight"],
        "embed.weight": sd["model.embed_tokens.weight"],
        "head.weight": sd["lm_head.weight"],
        "hc_head_fn": sd["model.hc_head.hc_fn"],
        "layers.1.ffn.experts.2.w1.weight": sd["model.layers.1.mlp.experts.gate_up_proj"][2, :64],
        "layers.1.ffn.experts.2.w3.weight": sd["model.layers.1.mlp.experts.gate_up_proj"][2, 64:],
        "layers.1.ffn.gate.bias": sd["model.layers.1.mlp.gate.e_score_correction_bias"],
    }
    for name, ref in pairs.items():
        assert torch.equal(st[name], ref), name
    assert st["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    # with the MTP block the config expects, every mtp.* tensor is reported missing in one error
    msg = _one_error(validate, ck, config_from_dict(json.loads((d / "config.json").read_text())))
    assert "missing tensor mtp.0.e_proj.weight" in msg


# --------------------------------------------------------------------------- malformed checkpoints


def test_all_problems_in_one_error(tmp_path, mini_tensors):
    t = dict(mini_tensors)
    del t["norm.weight"], t["layers.2.attn.wo_b.weight"]  # missing
    t["layers.9.attn.bogus.weight"] = torch.zeros(3)  # unexpected
    t["layers.1.attn_norm.weight"] = torch.ones(7, dtype=torch.bfloat16)  # mis-shaped
    t["layers.0.attn.wq_b.weight"] = t["layers.0.attn.wq_b.weight"].to(torch.bfloat16)  # mis-typed (fp8 expected)
    t["layers.3.ffn.gate.bias"] = torch.zeros(MINI.n_routed_experts, dtype=torch.int32)  # mis-typed
    d = _write(tmp_path / "m", t)
    msg = _one_error(validate, open_checkpoint(d), MINI)
    lines = msg.splitlines()
    assert lines[0].startswith("6 problems in checkpoint") and d in lines[0] and len(lines) == 7
    for needle in (
        "missing tensor norm.weight",
        "missing tensor layers.2.attn.wo_b.weight",
        "unexpected tensor layers.9.attn.bogus.weight in " + os.path.join(d, "model-00001-of-00001.safetensors"),
        "mis-shaped tensor layers.1.attn_norm.weight: [7], expected [256]",
        "mis-typed tensor layers.0.attn.wq_b.weight: BF16, expected F8_E4M3",
        "mis-typed tensor layers.3.ffn.gate.bias: I32",
    ):
        assert needle in msg, needle
    with pytest.raises(CheckpointError):  # load_state validates first
        load_state(open_checkpoint(d), MINI, progress=False)


def test_fp8_weight_without_scale_is_missing(tmp_path, mini_tensors):
    t = dict(mini_tensors)
    del t["layers.0.attn.wq_a.scale"]
    msg = _one_error(validate, open_checkpoint(_write(tmp_path / "m", t)), MINI)
    assert msg.splitlines()[0].startswith("1 problem in") and "missing tensor layers.0.attn.wq_a.scale" in msg


def _shard(d) -> pathlib.Path:
    return sorted(pathlib.Path(d).glob("*.safetensors"))[0]


def test_truncated_shard_names_file(tmp_path, mini_tensors):
    f = _shard(_write(tmp_path / "m", mini_tensors))
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    msg = _one_error(open_checkpoint, str(tmp_path / "m"))
    assert str(f) in msg and "past the end" in msg and "\n" not in msg


@pytest.mark.parametrize(
    "head", [b"\xff" * 8 + b"junk", (20).to_bytes(8, "little") + b"this is not json....."], ids=["length", "json"]
)
def test_garbage_header_names_file(tmp_path, mini_tensors, head):
    f = _shard(_write(tmp_path / "m", mini_tensors))
    data = f.read_bytes()
    f.write_bytes(head + data[len(head):])
    msg = _one_error(open_checkpoint, str(tmp_path / "m"))
    assert str(f) in msg and "\n" not in msg


def test_index_naming_missing_shard(tmp_path, mini_tensors):
    d = pathlib.Path(_write(tmp_path / "m", mini_tensors, max_shard_bytes=1 << 20))
    victim = sorted(d.glob("*.safetensors"))[1]
    victim.unlink()
    msg = _one_error(open_checkpoint, str(d))
    assert str(d / INDEX_NAME) in msg and victim.name in msg and "\n" not in msg


def test_malformed_index_json(tmp_path, mini_tensors):
    d = pathlib.Path(_write(tmp_path / "m", mini_tensors))
    (d / INDEX_NAME).write_text('{"weight_map": {"a": ')
    msg = _one_error(open_checkpoint, str(d))
    assert str(d / INDEX_NAME) in msg and "\n" not in msg


def test_malformed_config_json(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 256,')
    with pytest.raises(ConfigError) as ei:
        load_config(str(tmp_path))
    assert str(tmp_path / "config.json") in str(ei.value)


def test_missing_dir_and_empty_dir(tmp_path):
    assert str(tmp_path / "nope") in _one_error(open_checkpoint, str(tmp_path / "nope"))
    assert "no *.safetensors" in _one_error(open_checkpoint, str(tmp_path))


def test_device_fit_check(tmp_path, mini_tensors, monkeypatch):
    ck = open_checkpoint(_write(tmp_path / "m", mini_tensors))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (1 << 30, 80 << 30))
    msg = _one_error(_check_fits, ck, 3 << 30, torch.device("cuda:0"))
    assert "needs 3.00 GiB" in msg and "1.00 GiB free" in msg
    _check_fits(ck, 3 << 30, torch.device("cpu"))  # CPU: never checked


def test_writer_handles_tied_and_view_tensors(tmp_path):
    base = torch.randn(4, 8)
    d = write_checkpoint(str(tmp_path / "m"), {"a": base, "b": base, "c": base[1:3]}, {})
    ck = open_checkpoint(d)
    assert torch.equal(ck.get("b"), base) and torch.equal(ck.get("c"), base[1:3])


def test_tiny_model_broken_dir_is_reported(tmp_path, monkeypatch):
    from deepinfer.tiny import ensure_tiny_model, tiny_model_dir

    monkeypatch.setenv("DEEPINFER_HOME", str(tmp_path))
    os.makedirs(tiny_model_dir())
    assert tiny_model_dir() in _one_error(ensure_tiny_model, False)


def test_writer_refuses_existing_dir(tmp_path, mini_tensors):
    (tmp_path / "m").mkdir()
    with pytest.raises(FileExistsError):
        _write(tmp_path / "m", mini_tensors)
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temporary directory left behind


def test_nothing_is_unpickled():
    root = pathlib.Path(__file__).parents[1] / "deepinfer"
    for p in [*root.joinpath("checkpoint").glob("*.py"), root / "tiny.py"]:
        src = p.read_text()
        assert "torch.load(" not in src and "import pickle" not in src, p


# --------------------------------------------------------------------------- the tiny model


@pytest.fixture(scope="module")
def tiny_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("home1")
    mp = pytest.MonkeyPatch()
    mp.setenv("DEEPINFER_HOME", str(home))
    from deepinfer.tiny import ensure_tiny_model

    d = ensure_tiny_model(progress=False)
    mp.undo()
    return home, d


def test_tiny_model_location_and_validity(tiny_home, monkeypatch):
    from deepinfer.tiny import ensure_tiny_model, tiny_model_dir

    home, d = tiny_home
    assert d == str(home / "models" / "deepinfer-tiny-v1")
    monkeypatch.setenv("DEEPINFER_HOME", str(home))
    assert tiny_model_dir() == d and ensure_tiny_model(progress=False) == d  # second call: cached
    monkeypatch.delenv("DEEPINFER_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", "/x")
    assert tiny_model_dir() == "/x/deepinfer/models/deepinfer-tiny-v1"
    cfg = load_config(d)
    assert cfg.to_dict() == tiny_config().to_dict()
    ck = open_checkpoint(d)
    assert len(ck.files) == 2
    validate(ck, cfg)
    st = load_state(ck, cfg, progress=True)
    assert st["head.weight"].shape == (129280, 256) and st["layers.0.ffn.experts.7.w2.weight"].dtype == torch.int8
    tid = st["layers.0.ffn.gate.tid2eid"]
    assert ck.spec("layers.0.ffn.gate.tid2eid")[0] == "I32"
    assert 0 <= tid.min() and tid.max() < cfg.n_routed_experts and bool((tid[:, 0] != tid[:, 1]).all())
    for name in ("embed.weight", "layers.0.attn.wq_a.weight"):
        assert ck.spec(name)[0] in ("BF16", "F8_E4M3")
    assert ck.spec("layers.1.attn.attn_sink")[0] == "F32" and ck.spec("layers.1.ffn.gate.bias")[0] == "F32"


def test_tiny_model_is_deterministic(tiny_home, tmp_path, monkeypatch):
    from deepinfer.tiny import ensure_tiny_model

    monkeypatch.setenv("DEEPINFER_HOME", str(tmp_path))
    d2 = ensure_tiny_model(progress=False)
    d1 = tiny_home[1]
    files = sorted(os.listdir(d1))
    assert files == sorted(os.listdir(d2))
    match, mismatch, errors = filecmp.cmpfiles(d1, d2, files, shallow=False)
    assert not mismatch and not errors


def test_tiny_model_race_uses_winner(tmp_path, monkeypatch, mini_tensors):
    """If another process finishes the directory while we generate, our rename loses and we use theirs."""
    import deepinfer.tiny as tiny

    monkeypatch.setenv("DEEPINFER_HOME", str(tmp_path))
    d = tiny.tiny_model_dir()

    def racing_tensors(cfg=None):
        write_checkpoint(d, mini_tensors, {"winner": True})  # the other process wins
        return mini_tensors

    monkeypatch.setattr(tiny, "tiny_tensors", racing_tensors)
    assert tiny.ensure_tiny_model(progress=False) == d
    assert json.loads(pathlib.Path(d, "config.json").read_text()) == {"winner": True}
    assert os.listdir(tmp_path / "models") == ["deepinfer-tiny-v1"]  # loser's temporary dir removed


@pytest.mark.parametrize("bad", [-1, 8])
def test_a_hash_table_routing_outside_the_experts_is_refused(monkeypatch, bad, tiny_dir):
    """A tid2eid entry outside 0..n_routed_experts-1 is refused at load, naming the tensor and the range: the
    expert GEMMs rely on every routed id being an expert (no row of theirs is left unwritten)."""
    from deepinfer.engine.loader import load_model
    from deepinfer.model.weights import WeightSource

    real = WeightSource.raw

    def raw(self, name):
        t = real(self, name)
        if name.endswith("gate.tid2eid"):
            t = t.clone()
            t[3, 1] = bad
        return t

    monkeypatch.setattr(WeightSource, "raw", raw)
    with pytest.raises(ValueError, match=rf"layers.0.ffn.gate.tid2eid routes to experts .*{bad}.*outside the "
                                         r"model's 0\.\.7"):
        load_model(None, progress=False)
