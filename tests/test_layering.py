"""Every import arrow points down: cli -> debug (the toolkit) -> engine -> model -> ops / capture -> quant.
The model reaches the toolkit only through the tap seam `deepinfer/capture.py`; nothing above the registry
imports a backend's modules (`registry.backend_facts` reports what a backend chose)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package -> packages it must not import (at any depth, lazily inside functions too)
FORBIDDEN = {
    "deepinfer.quant": ("deepinfer.ops", "deepinfer.model", "deepinfer.engine", "deepinfer.debug", "deepinfer_cli"),
    "deepinfer.ops": ("deepinfer.model", "deepinfer.engine", "deepinfer.debug", "deepinfer_cli"),
    "deepinfer.capture": ("deepinfer.ops", "deepinfer.model", "deepinfer.engine", "deepinfer.debug", "deepinfer_cli"),
    "deepinfer.model": ("deepinfer.engine", "deepinfer.debug", "deepinfer_cli", "deepinfer_kernels"),
    "deepinfer.engine": ("deepinfer.debug", "deepinfer_cli", "deepinfer_kernels"),
    "deepinfer.debug": ("deepinfer_cli",),
    "deepinfer_cli": ("deepinfer_kernels",),
    "deepinfer_kernels": ("deepinfer.model", "deepinfer.engine", "deepinfer.debug", "deepinfer_cli"),
}


def _modules():
    for base, pkg in ((ROOT / "deepinfer", "deepinfer"), (ROOT / "deepinfer_cli", "deepinfer_cli"),
                      (ROOT / "deepinfer_kernels", "deepinfer_kernels")):
        for p in base.rglob("*.py"):
            rel = p.relative_to(base).with_suffix("")
            parts = [x for x in rel.parts if x != "__init__"]
            yield ".".join([pkg, *parts]), p


def _imports(mod: str, path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: against the module's package (a package's __init__ is its own)
                pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
                base = pkg[:len(pkg) - (node.level - 1)]
                yield ".".join(base + ([node.module] if node.module else [])), node.lineno
            elif node.module:
                yield node.module, node.lineno


def _owner(mod: str) -> str | None:
    best = None
    for pkg in FORBIDDEN:
        if mod == pkg or mod.startswith(pkg + "."):
            best = pkg if best is None or len(pkg) > len(best) else best
    return best


def test_imports_point_down():
    bad = []
    for mod, path in _modules():
        owner = _owner(mod)
        if owner is None:
            continue
        for target, line in _imports(mod, path):
            for f in FORBIDDEN[owner]:
                if target == f or target.startswith(f + "."):
                    bad.append(f"{path.relative_to(ROOT)}:{line}: {mod} imports {target}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("edge", ["deepinfer.model -> deepinfer.engine", "deepinfer_cli -> deepinfer_kernels"])
def test_the_check_sees_a_wrong_arrow(edge, tmp_path):
    """The walker resolves imports (absolute, inside functions) as the test needs: a planted wrong one is found."""
    src, dst = edge.split(" -> ")
    p = tmp_path / "m.py"
    p.write_text(f"def f():\n    from {dst}.x import y\n", encoding="utf-8")
    targets = [t for t, _ in _imports(src + ".m", p)]
    assert any(t.startswith(dst) for t in targets) and dst in FORBIDDEN[_owner(src + ".m")]


def test_backend_facts(monkeypatch):
    from deepinfer.ops.registry import backend_facts

    assert backend_facts("torch", "cpu") == {}
    f = backend_facts("triton", __import__("torch").device("cpu"))
    assert f["fp8_prefill_gemm"].startswith("triton") and f["fp8_prefill_min_m"] > 0
