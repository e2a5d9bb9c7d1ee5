"""The FlagGems kernel backend on a CPU (flag_gems need not be installed): registration, the install hint, that
importing the backend never imports flag_gems (its import creates a CUDA context: only on the first kernel call,
on the tensor's device), and the visible fallback outside the kernels' contract."""

import importlib
import sys

import pytest
import torch

from deepinfer.ops import ops
from deepinfer.ops.registry import REGISTRY, BackendError, Dispatcher, load_backend


@pytest.fixture
def fake_installed(monkeypatch):
    """flag_gems 'installed' (find_spec answers) but importing it fails loudly: nothing may import it here."""
    real = importlib.util.find_spec

    def find_spec(name, *a, **k):
        return object() if name == "flag_gems" else real(name, *a, **k)

    class Trap:
        def find_spec(self, name, path=None, target=None):
            if name == "flag_gems" or name.startswith("flag_gems."):
                raise AssertionError(f"{name} imported")
            return None

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(sys, "meta_path", [Trap(), *sys.meta_path])
    for m in [m for m in sys.modules if m.startswith("flag_gems")]:
        monkeypatch.delitem(sys.modules, m)
    for m in [m for m in sys.modules if m.startswith("deepinfer_kernels.flaggems")]:
        monkeypatch.delitem(sys.modules, m)
    for d in REGISTRY.values():
        if "flaggems" in d.impls:
            monkeypatch.delitem(d.impls, "flaggems")
    yield


def test_missing_package_is_one_line_with_the_install_hint(monkeypatch):
    if importlib.util.find_spec("flag_gems") is not None:
        pytest.skip("flag_gems is installed here")
    monkeypatch.delitem(sys.modules, "deepinfer_kernels.flaggems", raising=False)
    with pytest.raises(BackendError, match=r"needs the flag_gems package, which is not installed: "
                                           r"pip install -e '\.\[flaggems\]'"):
        load_backend("flaggems")


def test_loading_the_backend_does_not_import_flag_gems(fake_installed):
    load_backend("flaggems")
    assert "flag_gems" not in sys.modules
    assert {"act_quant", "fp8_gemm", "hc_pre", "hc_post", "sparse_attn"} <= {
        n for n, d in REGISTRY.items() if "flaggems" in d.impls}
    d = Dispatcher().configure("flaggems", strict=True, op_map={})  # every op wrapped or reference-only
    assert d.missing() == []


def test_off_contract_falls_back_visibly_and_strict_refuses(fake_installed, capsys):
    load_backend("flaggems")
    x = torch.randn(4, 256)
    ops.configure("flaggems", strict=False, op_map={})
    try:
        q, s = ops.act_quant(x, 128)  # a CPU tensor: outside the kernel's contract
        rq, rs = REGISTRY["act_quant"].ref(x, 128)
        assert torch.equal(q.float(), rq.float()) and torch.equal(s, rs)
        assert "FlagGems kernels run on CUDA" in ops.fallbacks["act_quant"]
        assert "op act_quant falls back to the torch reference" in capsys.readouterr().err
        assert "flag_gems" not in sys.modules
        ops.configure("flaggems", strict=True, op_map={})
        with pytest.raises(BackendError, match="--strict: op 'rms_norm': FlagGems kernels run on CUDA"):
            ops.rms_norm(x, None, 1e-6)
    finally:
        ops.configure("torch", strict=False, op_map={})


def test_bf16_only_kernels_name_the_dtype(fake_installed):
    load_backend("flaggems")
    from deepinfer_kernels.flaggems import attention, mhc

    ops.configure("flaggems", strict=False, op_map={})
    try:
        x, res = torch.randn(1, 2, 64), torch.randn(1, 2, 4, 64)
        post, comb = torch.rand(1, 2, 4), torch.rand(1, 2, 4, 4)
        assert torch.equal(mhc.hc_post(x, res, post, comb), REGISTRY["hc_post"].ref(x, res, post, comb))
        q, kv = torch.randn(1, 2, 16, 64), torch.randn(1, 8, 64)
        idx, sink = torch.randint(-1, 8, (1, 2, 4)), torch.zeros(16)
        assert torch.equal(attention.sparse_attn(q, kv, sink, idx, 0.1), REGISTRY["sparse_attn"].ref(q, kv, sink, idx, 0.1))
        assert "CUDA" in ops.fallbacks["hc_post"] and "CUDA" in ops.fallbacks["sparse_attn"]
    finally:
        ops.configure("torch", strict=False, op_map={})
