"""The environment fingerprint stored in every dump: what produced these numbers.

Library versions come from `importlib.metadata` only -- this module never imports Triton, TileLang or
FlagGems (importing them can initialise CUDA or compile, and must not happen for a CPU dump).
"""

from __future__ import annotations

import datetime
import importlib.metadata as md
import os
import platform
import socket
import subprocess
import sys

import torch

import deepinfer
from deepinfer import settings

# Fields that describe the machine/software rather than the run: `compare` lists those that differ.
ENV_FIELDS = ("deepinfer_version", "git_revision", "backend", "numerics", "dtype", "device", "device_name",
              "compute_capability", "driver_version", "cuda_version", "torch_version", "triton_version",
              "triton_is_flagtree", "tilelang_version", "flag_gems_version", "python_version", "hostname")
# Fields two dumps must share to be paired at all (else compare exits 2).
PAIRING_FIELDS = ("config_fingerprint", "prompt")


def dist_version(*names: str) -> str:
    """Installed version of the first distribution found among `names`, else ''."""
    for n in names:
        try:
            return md.version(n)
        except md.PackageNotFoundError:
            continue
    return ""


def triton_distribution() -> tuple[str, str, bool]:
    """(distribution name, version, is FlagTree) of whatever provides the `triton` module.

    FlagTree ships its Triton fork either as a distribution named `flagtree` or as `triton` with a
    FlagTree version string / metadata; any of these counts.
    """
    try:
        providers = md.packages_distributions().get("triton", [])
    except Exception:
        providers = []
    for name in list(providers) + ["triton", "flagtree"]:
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        meta = dist.metadata
        text = " ".join(str(meta.get(k, "")) for k in ("Name", "Summary", "Home-page", "Author"))
        is_ft = "flagtree" in (name + dist.version + text).lower()
        return meta.get("Name", name), dist.version, is_ft
    return "", "", False


def git_revision() -> str:
    """HEAD of the checkout deepinfer runs from, '+dirty' when tracked files changed; '' outside git."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(deepinfer.__file__)))
    try:
        rev = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5).stdout.strip()
        if not rev:
            return ""
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return ""


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _nvidia_driver() -> str:
    try:  # the kernel module's version line; no subprocess, no NVML
        with open("/proc/driver/nvidia/version", encoding="utf-8") as f:
            first = f.readline()
        for tok in first.split():
            if tok[:1].isdigit() and "." in tok:
                return tok
    except OSError:
        pass
    return ""


def device_info(device: torch.device | str) -> dict:
    dev = torch.device(device)
    if dev.type == "cuda":
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        cc = torch.cuda.get_device_capability(idx)
        return {"device": str(dev), "device_name": torch.cuda.get_device_name(idx),
                "compute_capability": f"{cc[0]}.{cc[1]}", "driver_version": _nvidia_driver(),
                "cuda_version": torch.version.cuda or (f"hip {torch.version.hip}" if torch.version.hip else "")}
    return {"device": str(dev), "device_name": _cpu_name(), "compute_capability": "", "driver_version": "",
            "cuda_version": torch.version.cuda or ""}


def environment(device: torch.device | str = "cpu") -> dict:
    """Software and machine fields (flat str/bool values, HDF5-attribute ready)."""
    tname, tver, is_ft = triton_distribution()
    return {
        "deepinfer_version": deepinfer.__version__,
        "git_revision": git_revision(),
        **device_info(device),
        "torch_version": torch.__version__,
        "triton_version": f"{tname} {tver}".strip() if tname and tname.lower() != "triton" else tver,
        "triton_is_flagtree": is_ft,
        "tilelang_version": dist_version("tilelang"),
        "flag_gems_version": dist_version("flag_gems", "flag-gems"),
        "python_version": platform.python_version(),
        "hostname": socket.gethostname(),
    }


def run_fingerprint(*, device, backend: str, numerics: str, dtype: str, model_path: str, model_name: str,
                    config_fingerprint: str, prompt: str, seed: int, **extra) -> dict:
    """Everything a dump's root attributes carry: environment + this run's settings + `extra`."""
    return {
        **environment(device),
        "backend": backend, "numerics": numerics, "dtype": dtype,
        "model_path": os.path.abspath(model_path) if model_path else "", "model_name": model_name,
        "config_fingerprint": config_fingerprint, "prompt": prompt, "seed": int(seed),
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "settings": settings.snapshot(),
        **extra,
    }


def differing(a: dict, b: dict, fields=ENV_FIELDS) -> dict:
    """{field: (a's value, b's value)} for the fields whose values differ."""
    return {k: (a.get(k, ""), b.get(k, "")) for k in fields if a.get(k, "") != b.get(k, "")}
