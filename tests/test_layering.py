"""Every import arrow points down: cli -> debug (the toolkit) -> bench -> hf (transformers interop) -> engine ->
model -> ops / capture -> quant. The model reaches the toolkit only through the tap seam `deepinfer/capture.py`
and holds no engine state (the runners keep their streams and graphs); nothing above the registry imports a
backend's modules (`registry.backend_facts` reports what a backend chose), and "can this backend run on this
device" has one home, `registry.check_runs_on`."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package -> packages it must not import (at any depth, lazily inside functions too)
_ABOVE_ENGINE = ("deepinfer.hf", "deepinfer.bench", "deepinfer.debug", "deepinfer_cli")
FORBIDDEN = {
    "deepinfer.quant": ("deepinfer.ops", "deepinfer.model", "deepinfer.engine", *_ABOVE_ENGINE),
    "deepinfer.ops": ("deepinfer.model", "deepinfer.engine", *_ABOVE_ENGINE),
    "deepinfer.capture": ("deepinfer.ops", "deepinfer.model", "deepinfer.engine", *_ABOVE_ENGINE),
    "deepinfer.model": ("deepinfer.engine", *_ABOVE_ENGINE, "deepinfer_kernels"),
    "deepinfer.engine": (*_ABOVE_ENGINE, "deepinfer_kernels"),
    "deepinfer.hf": ("deepinfer.bench", "deepinfer.debug", "deepinfer_cli", "deepinfer_kernels"),
    "deepinfer.bench": ("deepinfer.debug", "deepinfer_cli", "deepinfer_kernels"),
    "deepinfer.debug": ("deepinfer_cli", "deepinfer_kernels"),
    "deepinfer_cli": ("deepinfer_kernels",),
    "deepinfer_kernels": ("deepinfer.model", "deepinfer.engine", *_ABOVE_ENGINE),
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


def _device_checks(path: Path) -> list[int]:
    """Lines of `path` that decide on their own whether a backend runs on a device: a comparison of a
    `.type` with "cuda" next to a mention of a backend name or `BackendError` in the same function."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    hits = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        src = ast.get_source_segment(path.read_text(encoding="utf-8"), fn) or ""
        if "BackendError(" in src and "needs a CUDA device" in src:
            hits.append(fn.lineno)
    return hits


def test_one_device_check():
    """"needs a CUDA device" for a backend is decided in `registry.check_runs_on` only: the CLI, bench and the
    toolkit call it (a second copy with its own rules is how the CLI and bench disagreed)."""
    home = ROOT / "deepinfer" / "ops" / "registry.py"
    bad = [f"{p.relative_to(ROOT)}:{ln}" for _, p in _modules() if p != home for ln in _device_checks(p)]
    assert not bad, "backend device checks outside the registry: " + ", ".join(bad)
    assert _device_checks(home), "the registry's check_runs_on is gone or no longer raises"


def test_the_device_check_is_found(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("def f(b, dev):\n    if dev.type != 'cuda':\n        raise BackendError(f'{b} needs a CUDA device')\n",
                 encoding="utf-8")
    assert _device_checks(p) == [1]


def test_check_runs_on(monkeypatch):
    import torch

    from deepinfer import settings
    from deepinfer.ops.registry import BackendError, check_runs_on

    check_runs_on("torch", torch.device("cpu"), "bfloat16")
    check_runs_on("tilelang", torch.device("cuda", 0), "bfloat16")
    with pytest.raises(BackendError, match="--op backend tilelang needs a CUDA device"):
        check_runs_on("tilelang", torch.device("cpu"), "float32", "--op backend")
    monkeypatch.setattr(settings, "triton_interpreted", lambda: True)
    check_runs_on("triton", torch.device("cpu"), "float32")
    with pytest.raises(BackendError, match="bf16 tl.dot wrongly"):
        check_runs_on("triton", torch.device("cpu"), "bfloat16")
    monkeypatch.setattr(settings, "triton_interpreted", lambda: False)
    with pytest.raises(BackendError, match="--backend triton needs a CUDA device"):
        check_runs_on("triton", torch.device("cpu"), "float32")


# every module whose objects are engine state: what a model must never hold (the runners keep it)
_ENGINE_STATE = ("deepinfer.engine.", "deepinfer.bench.", "torch.cuda.graphs")


def _engine_refs(obj, seen: set, path: str, out: list) -> None:
    """Walk `obj`'s attributes (objects, lists, dicts) and collect paths to instances of engine-state types."""
    if id(obj) in seen or isinstance(obj, (int, float, str, bytes, bool, type(None))):
        return
    seen.add(id(obj))
    import torch

    if isinstance(obj, torch.Tensor):
        return
    mod = type(obj).__module__ or ""
    if any(mod.startswith(m.rstrip(".")) for m in _ENGINE_STATE):
        out.append(f"{path}: {mod}.{type(obj).__name__}")
        return
    if isinstance(obj, (list, tuple, set)):
        for i, x in enumerate(obj):
            _engine_refs(x, seen, f"{path}[{i}]", out)
    elif isinstance(obj, dict):
        for k, x in obj.items():
            _engine_refs(x, seen, f"{path}[{k!r}]", out)
    elif hasattr(obj, "__dict__") and mod.startswith("deepinfer"):
        for k, x in vars(obj).items():
            _engine_refs(x, seen, f"{path}.{k}", out)


def test_model_holds_no_engine_state():
    """After the runners decode with it (and a speculative step), the model holds nothing of theirs: streams and
    graphs belong to the runner (`deepinfer.engine.steps` keeps runners per model, outside it)."""
    import torch

    from deepinfer.engine.loader import build_model, resolve_numerics
    from deepinfer.engine.random_weights import random_state
    from deepinfer.engine.runner import DecodeRunner
    from deepinfer.presets import preset_config

    cfg = preset_config("tiny")
    model = build_model(cfg, random_state(cfg, torch.device("cpu"), 0), resolve_numerics("official", "float32"),
                        torch.device("cpu"))
    model.allocate(2, 16)
    rows = torch.arange(2)
    for i in range(2):
        model.prefill(torch.randint(2, cfg.vocab_size, (1, 5)), rows=rows[i:i + 1])
    runner = DecodeRunner(model, 2)
    runner.decode(torch.randint(2, cfg.vocab_size, (2, 1)), torch.full((2,), 5), rows)
    out: list[str] = []
    _engine_refs(model, set(), "model", out)
    assert not out, out
    bad: list[str] = []
    model.planted = runner  # the walk sees a runner planted on the model
    _engine_refs(model, set(), "model", bad)
    assert bad == ["model.planted: deepinfer.engine.runner.DecodeRunner"], bad


def test_every_package_is_installed():
    """pyproject's package list names every package folder: a folder left out imports from a checkout (the tests'
    working directory) but not from a wheel."""
    import re

    listed = set(re.findall(r'"([\w.]+)"', (ROOT / "pyproject.toml").read_text(encoding="utf-8")
                            .split("[tool.setuptools]")[1].split("]")[0]))
    found = {".".join(p.parent.relative_to(ROOT).parts) for base in ("deepinfer", "deepinfer_cli", "deepinfer_kernels")
             for p in (ROOT / base).rglob("__init__.py")}
    assert found - listed == set(), f"not in pyproject's packages: {sorted(found - listed)}"
