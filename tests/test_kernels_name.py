"""The repository's kernels/ folder, found as `kernels` (the repository root on sys.path, as `python -m` from it puts
it), must not hide Hugging Face's `kernels` package, which transformers 5.25 imports as it builds a model."""
import importlib.metadata
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _import_kernels_from_the_root() -> subprocess.CompletedProcess:
    code = "import kernels; print(kernels.__file__)"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_kernels_from_the_repository_root_is_hugging_faces_or_absent():
    try:
        importlib.metadata.distribution("kernels")
        installed = True
    except importlib.metadata.PackageNotFoundError:
        installed = False
    p = _import_kernels_from_the_root()
    if installed:
        assert p.returncode == 0, p.stderr[-2000:]
        where = os.path.abspath(p.stdout.strip())
        assert not where.startswith(os.path.join(ROOT, "kernels") + os.sep), where
    else:
        assert p.returncode != 0 and "deepinfer_kernels" in p.stderr, p.stderr[-2000:]


def test_deepinfer_kernels_is_the_folder_and_loads_nothing_else(tmp_path):
    """Under its own name the folder is itself and leaves the name `kernels` alone (run outside the repository, so
    its root is not on sys.path)."""
    code = "import sys, deepinfer_kernels; print(deepinfer_kernels.__file__); print('kernels' in sys.modules)"
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    where, loaded = p.stdout.split()
    assert os.path.samefile(os.path.dirname(where), os.path.join(ROOT, "kernels")), where
    assert loaded == "False"
