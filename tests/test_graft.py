"""`deepinfer graft`: each local layer on a reference dump's inputs; a divergence planted at one layer is
named there and nowhere else, and identical configurations add no error."""

import json

import pytest
from typer.testing import CliRunner

from deepinfer.debug.graft import graft, grafted_layers
from deepinfer.debug.h5schema import DumpReader
from deepinfer.engine.loader import load_model
from deepinfer.ops import ops
from deepinfer.ops.registry import REGISTRY
from deepinfer_cli.app import app

runner = CliRunner()


@pytest.fixture(scope="module")
def ref_dump(tmp_path_factory, tiny_dir):
    path = str(tmp_path_factory.mktemp("graft") / "ref.h5")
    r = runner.invoke(app, ["dump", "北京是中国的首都，上海是", "--steps", "3", "--backend", "torch",
                            "--dtype", "float32", "--device", "cpu", "-o", path])
    assert r.exit_code == 0, r.output
    return path


def test_identical_configuration_adds_nothing(ref_dump):
    r = runner.invoke(app, ["graft", "--ref", ref_dump, "--backend", "torch", "--device", "cpu", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output.strip().splitlines()[-1])
    assert d["born_at"] is None and len(d["layers"]) == 4 and d["steps"] == 3
    assert all(e["prefill"] == 0.0 and e["decode"] == 0.0 for e in d["layers"]), d["layers"]


def test_planted_divergence_is_named_at_its_layer(ref_dump):
    ops.configure("torch")
    model = load_model(None, "official", "float32", "cpu", progress=False).model

    def perturbed(name):
        ref = REGISTRY[name].ref
        return lambda *a, **k: ref(*a, **k) * 1.01

    # both post-mixes of layer 2: the attention's (`hc_post`) and the MoE's, which the block fuses with the
    # sum of routed and shared rows (`moe_combine_post`) as the engine runs it
    ops.override_sites({("hc_post", 2): perturbed("hc_post"), ("moe_combine_post", 2): perturbed("moe_combine_post")})
    try:
        with DumpReader(ref_dump) as d:
            res = graft(model, d)
    finally:
        ops.override_sites(None)
    errs = {e.layer: max(e.prefill, e.decode) for e in res.layers}
    assert res.first_over is not None and res.first_over.layer == 2, errs
    assert errs[2] > 1e-3 and all(errs[L] == 0.0 for L in (0, 1, 3)), errs


def test_bad_input(ref_dump, tmp_path):
    r = runner.invoke(app, ["graft", "--ref", str(tmp_path / "none.h5"), "--backend", "torch", "--device", "cpu"])
    assert r.exit_code == 2
    with DumpReader(ref_dump) as d:
        assert grafted_layers(list(d.names())) == [0, 1, 2, 3]
        model = load_model(None, "official", "float32", "cpu", progress=False).model
        with pytest.raises(ValueError, match="layer"):
            graft(model, d, [7])
