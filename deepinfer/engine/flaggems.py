"""`--flaggems op,...`: run the engine with FlagGems enabled for an allow-list of ops only.

An allow-list keeps every intermediate state safe (unproven ops stay on PyTorch); the field notes found a
deny-list bitten once per run (`mul` broadcasting, `cat` on e8m0, `topk` compile time, ...). Names are
resolved against FlagGems' registration table first, because some register under another name
(`softmax` is `_softmax`): an unresolved name is an error with the close matches, never a silent no-op.
Call after the device is chosen: importing flag_gems initialises a CUDA context.
"""

from __future__ import annotations

import difflib
import importlib.util

from deepinfer.engine.loader import OptionError


def enable_only(flag_gems, resolved: list[str], known: list[str]) -> str:
    """Enable exactly the FlagGems ops `resolved` (of its registration table `known`): `only_enable` where
    the build has it, else `enable` with every other op unused. Returns which call was used."""
    if hasattr(flag_gems, "only_enable"):
        flag_gems.only_enable(include=resolved)
        return "only_enable(include=...)"
    flag_gems.enable(unused=[n for n in known if n not in resolved])
    return "enable(unused=everything else)"


def resolve_op_names(requested: list[str], known: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """Split requested FlagGems op names into (resolved, {unresolved: close matches}), e.g. softmax -> _softmax."""
    known_set = set(known)
    resolved, unresolved = [], {}
    for n in requested:
        if n in known_set:
            resolved.append(n)
            continue
        close = difflib.get_close_matches(n, known, n=3, cutoff=0.6)
        if "_" + n in known_set and "_" + n not in close:
            close.insert(0, "_" + n)
        unresolved[n] = close
    return resolved, unresolved


def parse_names(spec: str | None) -> list[str]:
    return [n.strip() for n in (spec or "").split(",") if n.strip()]


def enable_flaggems(names: list[str], device, require_cuda: bool = True) -> dict:
    """Enable FlagGems for exactly `names` (after resolving them); -> {"requested", "enabled", "how"}."""
    if not names:
        return {}
    if importlib.util.find_spec("flag_gems") is None:
        raise OptionError("--flaggems: flag_gems is not installed (pip install flag-gems)")
    if require_cuda and getattr(device, "type", str(device)) != "cuda":
        raise OptionError(f"--flaggems needs a CUDA device (device is {device}): FlagGems registers CUDA kernels")
    import flag_gems

    cfg = getattr(flag_gems, "_FULL_CONFIG", None) or []
    known = sorted({str(e[0]) for e in cfg} | {getattr(e[1], "__name__", str(e[1])) for e in cfg if len(e) > 1})
    resolved, unresolved = resolve_op_names(names, known) if known else (names, {})
    if unresolved:
        hints = "; ".join(f"{n} (close: {', '.join(c) or 'none'})" for n, c in unresolved.items())
        raise OptionError(f"--flaggems: not in FlagGems' registration table: {hints}")
    return {"requested": names, "enabled": resolved, "how": enable_only(flag_gems, resolved, known)}
