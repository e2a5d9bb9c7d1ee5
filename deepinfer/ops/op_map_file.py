"""A tuned per-op map as a file: what `deepinfer tune` writes and `--op @FILE` reads (generate, bench, dump, ...).

The file is YAML:

    format: deepinfer-op-map/1
    device: NVIDIA H200            # torch.cuda.get_device_name() where it was tuned
    policy: official               # the numerics policy the kernels were held to
    backends: {triton: 3.6.0, tilelang: 0.1.15, torch: 2.11.0+cu130}   # every candidate, with its version
    installed: {triton: 3.6.0, tilelang: 0.1.15, flaggems: 5.0.2}        # every kernel backend installed there
    ops:
      grouped_gemm: {decode: triton, prefill: tilelang}
      sparse_attn: triton
    measured: {...}                # per op and phase: each candidate's ms, or why it was not eligible

A map holds only where it was measured: one for another GPU, another backend set (a candidate missing, another
version, or a kernel backend installed here that was not installed there) or another numerics policy is refused
in one line naming what differs, never applied.
"""

from __future__ import annotations

import datetime

FORMAT = "deepinfer-op-map/1"
POLICIES = ("official", "fast")
"""Numerics policies a map may be tuned under: `official` keeps only kernels that accumulate as the official ones
(within each op's tolerance of the reference); `fast` also takes those that promote FP8 sums to fp32 once per 128-K
block. A run accepts maps of its own policy only (DEEPINFER_POLICY, default official)."""


def device_name() -> str:
    """This machine's GPU as torch names it (the current CUDA device), or "cpu"."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def _yaml():
    try:
        import yaml
    except ImportError:
        raise ValueError("reading or writing a tuned op map needs PyYAML: pip install pyyaml") from None
    return yaml


def dump_op_map(path: str, ops: dict, device: str, policy: str, backends: dict, measured: dict,
                command: str = "", tuned: dict | None = None) -> None:
    """Write the map atomically (a temp file and a rename: an interrupted write leaves no half map). tuned: how
    it was measured (baseline, shapes, seed), for the reader."""
    from deepinfer.outpath import atomic_write

    from deepinfer.ops.registry import backend_versions

    installed = {b: v for b, v in backend_versions().items() if v is not None}
    doc = {"format": FORMAT, "device": device, "policy": policy, "backends": dict(backends), "installed": installed,
           "created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "command": command, **({"tuned": tuned} if tuned else {}), "ops": dict(sorted(ops.items())),
           "measured": measured}
    atomic_write(path, _yaml().safe_dump(doc, sort_keys=False, allow_unicode=True, width=120))


def load_op_map(path: str, what: str = "--op") -> dict:
    """{op: backend or {phase: backend}} from a tuned map file, after checking it was tuned for this machine."""
    from deepinfer.ops.registry import BACKENDS, REGISTRY, _parse_choice, backend_versions

    where = f"{what} @{path}"
    try:
        text = open(path, encoding="utf-8").read()
    except OSError as e:
        raise ValueError(f"{where}: cannot read it: {e.strerror or e}") from None
    try:
        doc = _yaml().safe_load(text)
    except ValueError:
        raise
    except Exception as e:  # a YAML syntax error: its first line says where
        raise ValueError(f"{where}: not YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"{where}: not a tuned op map (format {doc.get('format') if isinstance(doc, dict) else None!r}, "
                         f"expected {FORMAT!r}; `deepinfer tune` writes one)")
    from deepinfer import settings

    policy, run_policy = doc.get("policy"), settings.choice("DEEPINFER_POLICY") or "official"
    if policy != run_policy:
        raise ValueError(f"{where}: tuned under numerics policy {policy!r}; this run's is {run_policy!r} "
                         "(DEEPINFER_POLICY)")
    here = device_name()
    if doc.get("device") != here:
        raise ValueError(f"{where}: tuned on {doc.get('device')!r}, this machine has {here!r}: tune again here")
    tuned = doc.get("backends")
    if not isinstance(tuned, dict) or not tuned:
        raise ValueError(f"{where}: no `backends` recorded")
    unknown = set(tuned) - set(BACKENDS)
    if unknown:
        raise ValueError(f"{where}: unknown backends {sorted(unknown)}; backends: {', '.join(BACKENDS)}")
    now = backend_versions(list(tuned))
    diff = [f"{b} {tuned[b]} there, {now[b] or 'not installed'} here" for b in tuned if str(tuned[b]) != str(now[b])]
    there = doc.get("installed") or {}
    here_installed = {b: v for b, v in backend_versions().items() if v is not None}
    diff += [f"{b} {v} installed here, not there" for b, v in here_installed.items() if b not in there and b not in tuned]
    if diff:
        raise ValueError(f"{where}: tuned with another backend set: {'; '.join(diff)}: tune again here")
    ops = doc.get("ops")
    if not isinstance(ops, dict):
        raise ValueError(f"{where}: no `ops` mapping")
    out = {}
    for op, choice in ops.items():
        if op not in REGISTRY:
            raise ValueError(f"{where}: unknown op {op!r}")
        if not isinstance(choice, (str, dict)) or (isinstance(choice, dict) and not all(
                isinstance(k, str) and isinstance(v, str) for k, v in choice.items())):
            raise ValueError(f"{where}: {op}: {choice!r} is not a backend or a phase map (decode: BACKEND, prefill: "
                             "BACKEND)")
        text = choice if isinstance(choice, str) else "/".join(f"{k}:{v}" for k, v in choice.items())
        c = _parse_choice(text, f"{where}: {op}")
        if set([c] if isinstance(c, str) else c.values()) - set(tuned):
            raise ValueError(f"{where}: {op} names a backend that was not a candidate")
        out[op] = c
    return out
