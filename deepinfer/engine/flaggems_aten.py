"""`--flaggems op,...`: run the engine with FlagGems enabled for an allow-list of ops only.

An allow-list keeps every intermediate state safe (unproven ops stay on PyTorch); the field notes found a
deny-list bitten once per run (`mul` broadcasting, `cat` on e8m0, `topk` compile time, ...). Names are
resolved against FlagGems' registration table first, because some register under another name
(`softmax` is `_softmax`): an unresolved name is an error with the close matches, never a silent no-op.
Call after the device is chosen: importing flag_gems initialises a CUDA context, so it is imported under
`torch.cuda.device(device)` and only for a CUDA device.

FlagGems 5.0.2's `only_enable(include=[...])` matches *function* names (its FULL_CONFIG_BY_FUNC: `true_divide`
registers div.Tensor, div.Scalar, divide.Tensor, ...); a table key such as `add.Tensor` or `_softmax` matches
nothing there. So every resolved name, key or function, is passed as its function's name.
`--flaggems @FILE` reads the names from an allow-list file in only_enable's YAML form (`include:`), as
`deepinfer probe flaggems --screen --out FILE` writes it.
"""

from __future__ import annotations

import difflib
import importlib.util

from deepinfer.engine.loader import OptionError


def table_of(flag_gems) -> list[tuple[str, str]]:
    """[(ATen key, function name)] of an imported flag_gems' registration table."""
    cfg = getattr(flag_gems, "_FULL_CONFIG", None) or []
    return [(str(e[0]), getattr(e[1], "__name__", str(e[1]))) for e in cfg if len(e) > 1]


def function_names(resolved: list[str], table: list[tuple[str, str]]) -> list[str]:
    """Resolved names (ATen keys or function names) -> the function names only_enable matches, in order, once."""
    fn_of = dict(table)
    out: list[str] = []
    for n in resolved:
        f = fn_of.get(n, n)
        if f not in out:
            out.append(f)
    return out


def enable_only(flag_gems, resolved: list[str], known: list[str]) -> str:
    """Enable exactly the FlagGems ops `resolved` (keys or function names of its registration table): `only_enable`
    with their function names where the build has it, else `enable` with every other function unused. Returns
    which call was used."""
    table = table_of(flag_gems)
    fns = function_names(resolved, table)
    if hasattr(flag_gems, "only_enable"):
        flag_gems.only_enable(include=fns)
        return "only_enable(include=...)"
    flag_gems.enable(unused=sorted({f for _, f in table} - set(fns)))
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


def allow_yaml(allowed: list[str], header: list[str]) -> str:
    """The allow-list in FlagGems' only_enable YAML form (`include:` function names), with comment lines."""
    lines = [f"# {h}" for h in header] + ["include:"] + [f"  - {n}" for n in allowed]
    return "\n".join(lines) + ("\n" if lines else "")


def read_allow_yaml(path: str) -> list[str]:
    """The `include:` names of an allow-list file (a YAML mapping, or a bare list, as only_enable reads it)."""
    try:
        text = open(path, encoding="utf-8").read()
    except OSError as e:
        raise ValueError(f"cannot read the allow-list {path}: {e.strerror or e}") from None
    try:
        import yaml

        data = yaml.safe_load(text)
    except ImportError:
        data = {"include": [ln.strip()[2:].strip() for ln in text.splitlines() if ln.strip().startswith("- ")]}
    except Exception as e:
        raise ValueError(f"{path} is not YAML: {str(e).splitlines()[0]}") from None
    names = data.get("include") if isinstance(data, dict) else data
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{path}: expected `include:` followed by a list of FlagGems function names")
    return names


def parse_names(spec: str | None) -> list[str]:
    """`add,mul` -> names; `@allow.yaml` -> the `include:` names of that file (an unreadable or malformed file is
    an OptionError naming it)."""
    spec = (spec or "").strip()
    if spec.startswith("@"):
        try:
            names = read_allow_yaml(spec[1:])
        except ValueError as e:
            raise OptionError(f"--flaggems {spec}: {e}") from None
        if not names:
            raise OptionError(f"--flaggems {spec}: the allow-list is empty")
        return names
    return [n.strip() for n in spec.split(",") if n.strip()]


def enable_flaggems(names: list[str], device, require_cuda: bool = True) -> dict:
    """Enable FlagGems for exactly `names` (after resolving them); -> {"requested", "enabled", "how"}."""
    if not names:
        return {}
    if importlib.util.find_spec("flag_gems") is None:
        raise OptionError("--flaggems: flag_gems is not installed (pip install flag-gems)")
    if require_cuda and getattr(device, "type", str(device)) != "cuda":
        raise OptionError(f"--flaggems needs a CUDA device (device is {device}): FlagGems registers CUDA kernels")
    if getattr(device, "type", str(device)) == "cuda":
        import torch

        with torch.cuda.device(device):  # the CUDA context its import creates lands on the chosen device
            import flag_gems
    else:
        import flag_gems

    table = table_of(flag_gems)
    known = sorted({k for k, _ in table} | {f for _, f in table})
    resolved, unresolved = resolve_op_names(names, known) if known else (names, {})
    if unresolved:
        hints = "; ".join(f"{n} (close: {', '.join(c) or 'none'})" for n, c in unresolved.items())
        raise OptionError(f"--flaggems: not in FlagGems' registration table: {hints}")
    return {"requested": names, "enabled": resolved, "functions": function_names(resolved, table),
            "how": enable_only(flag_gems, resolved, known)}
