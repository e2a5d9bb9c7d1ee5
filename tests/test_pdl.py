"""Programmatic dependent launch: every Triton kernel of the package is launched with `**pdl()` (launch_pdl on
sm_90+) and waits (`pdl_wait()`, its first statement) for the previous kernel before reading or writing
anything.

A kernel launched with the flag but without the wait would race with its predecessor; a kernel with the
wait but launched without the flag only loses the overlap. Both sides are checked here from the source
(the interpreter runs no PDL); on the GPU every compiled-kernel and graph test runs with PDL on.
"""

import ast
import importlib
import inspect
import pkgutil
import textwrap

import pytest
import torch
import triton
import triton.language as tl

# the backend under the name the registry imports it by: importing it as `kernels.triton` too would load a
# second copy that re-registers every implementation (its own split-K tile counters, its own module state)
kt = importlib.import_module("deepinfer_kernels.triton")
_common = importlib.import_module("deepinfer_kernels.triton._common")


def _modules():
    for m in pkgutil.iter_modules(kt.__path__):
        if not m.name.startswith("_"):
            yield importlib.import_module(f"deepinfer_kernels.triton.{m.name}")


def _is_jit(obj) -> bool:
    """A @triton.jit function (a JITFunction, or an InterpretedFunction under TRITON_INTERPRET=1)."""
    return isinstance(obj, triton.JITFunction) or type(obj).__name__ == "InterpretedFunction"


def _first_statement(fn) -> str:
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn.fn)))
    body = tree.body[0].body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):  # docstring
        body = body[1:]
    return ast.unparse(body[0])


def _launches(mod):
    """(kernel name, whether it unpacks **pdl(), line) of every `name[grid](...)` call in mod."""
    tree = ast.parse(inspect.getsource(mod))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) \
                and isinstance(node.func.value, ast.Name):
            unpacks = [ast.unparse(k.value) for k in node.keywords if k.arg is None]
            yield node.func.value.id, "pdl()" in unpacks, node.lineno


def test_every_launch_takes_pdl_and_its_kernel_waits_first():
    n = 0
    for mod in _modules():
        for name, flag, line in _launches(mod):
            fn = getattr(mod, name, None)
            if not _is_jit(fn):
                continue
            n += 1
            assert flag, f"{mod.__name__}:{line}: {name} launched without **pdl()"
            assert _first_statement(fn) == "pdl_wait()", f"{mod.__name__}.{name}: first statement is not pdl_wait()"
    assert n >= 40  # every launch site of the package was seen (46 at the time of writing)


def test_every_kernel_waits_first():
    for mod in _modules():
        for name, fn in vars(mod).items():
            if _is_jit(fn) and name.endswith("_kernel") and fn.fn.__module__ == mod.__name__:
                assert _first_statement(fn) == "pdl_wait()", f"{mod.__name__}.{name}"


def test_plain_launch_under_the_interpreter_by_env_and_without_triton_support(monkeypatch):
    """{} (no launch_pdl keyword at all: Triton releases without PDL, and ROCm's, reject it even when false)."""
    monkeypatch.setattr(_common, "INTERPRET", True)
    assert _common.pdl() == {}
    monkeypatch.setattr(_common, "INTERPRET", False)
    monkeypatch.setattr(_common, "_PDL_ON", False)
    assert _common.pdl() == {}
    monkeypatch.setattr(_common, "_PDL_ON", True)
    monkeypatch.setattr(_common, "_PDL_TRITON", False)
    assert _common.pdl() == {}


def test_triton_without_pdl_support_launches_plainly(monkeypatch):
    """_common loaded against a Triton without grid dependency control (the import fails, as on releases
    before it or forks without it): pdl() launches plainly and pdl_wait is an empty function that kernels
    still compile / run with."""
    import importlib.util
    import sys

    monkeypatch.setitem(sys.modules, "triton.language.target_info", None)  # import -> ImportError
    spec = importlib.util.spec_from_file_location("_common_no_pdl", _common.__file__)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod._PDL_TRITON is False
    monkeypatch.setattr(mod, "INTERPRET", False)  # even when compiled
    assert mod.pdl() == {}
    monkeypatch.setitem(globals(), "_fallback_wait", mod.pdl_wait)  # jit functions resolve module globals
    x = torch.zeros(1, device="cuda" if torch.cuda.is_available() else "cpu")
    _probe_kernel[(1,)](x, **mod.pdl())
    assert x.item() == 1.0


_fallback_wait = None


@triton.jit
def _probe_kernel(x_ptr):
    _fallback_wait()
    tl.store(x_ptr, tl.load(x_ptr) + 1.0)


@pytest.mark.gpu
def test_pdl_chain_in_a_graph_matches_eager():
    """A chain of dependent PDL launches (rms_norm feeding itself, weights ~U[0.5, 1.5)) gives the same
    result eagerly and replayed from a CUDA graph, bit for bit: each kernel reads its predecessor's output
    only after pdl_wait (a race would read a half-written row)."""
    from deepinfer_kernels.triton.norm import rms_norm

    x0 = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(4096, device="cuda") + 0.5

    flags = []

    def chain(x):  # Triton launches back to back (no torch op in between breaks the PDL chain)
        flags.append(_common.pdl())
        for _ in range(50):
            x = rms_norm(x, w, 1e-6)
        return x

    ref = chain(x0)
    static = x0.clone()
    chain(static)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = chain(static)
    g.replay()
    torch.cuda.synchronize()
    assert flags == [{"launch_pdl": True}] * 3  # eager and captured launches alike
    assert torch.equal(out, ref)
