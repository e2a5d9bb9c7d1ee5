"""`deepinfer show FILE.h5`: a dump's fingerprint and its tensors as a tree with shapes, dtypes and statistics."""

from __future__ import annotations

import json
import re

import torch
import typer
from rich.table import Table
from rich.tree import Tree

from deepinfer.debug.compare import fmt
from deepinfer.debug.h5schema import DumpReader
from deepinfer_cli.console import console
from deepinfer_cli.errors import UserError, handle_errors


def tensor_stats(t: torch.Tensor) -> dict:
    """min/max/mean/std/absmax over the finite elements, NaN/Inf counts; integers: min/max only."""
    if t.numel() == 0:
        return {"numel": 0}
    if not t.is_floating_point():
        x = t.long()
        return {"numel": t.numel(), "min": int(x.min()), "max": int(x.max())}
    x = t.double().reshape(-1)
    fin = x[x.isfinite()]
    s = {"numel": t.numel(), "nan": int(x.isnan().sum()), "inf": int(x.isinf().sum())}
    if fin.numel():
        s.update(min=float(fin.min()), max=float(fin.max()), mean=float(fin.mean()),
                 std=float(fin.std()) if fin.numel() > 1 else 0.0, absmax=float(fin.abs().max()))
    return s


def _line(name: str, m: dict, st: dict | None) -> str:
    s = f"[bold]{name}[/bold] {list(m['shape'])} [cyan]{m['dtype']}[/cyan]"
    if st:
        keys = [k for k in ("min", "max", "mean", "std") if k in st]
        s += "  " + " ".join(f"{k} {fmt(st[k])}" for k in keys)
        if st.get("nan") or st.get("inf"):
            s += f"  [red]NaN {st['nan']} Inf {st['inf']}[/red]"
    return s


@handle_errors
def show_cmd(
    path: str = typer.Argument(..., help="A dump file (.h5)."),
    name_filter: str = typer.Option(None, "--filter", help="Only tensors whose name matches this regex."),
    stats: bool = typer.Option(True, "--stats/--no-stats", help="Compute summary statistics (reads every tensor)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object: attrs and per-tensor shape/dtype/stats."),
):
    """Show a dump: fingerprint, then the tensor tree (step → layer → module) with statistics.

    Example: deepinfer show dumps/ref.h5 --filter 'layers\\.0\\.'
    """
    try:
        flt = re.compile(name_filter) if name_filter else None
    except re.error as e:
        raise UserError(f"--filter {name_filter!r}: bad regex ({e})") from None
    with DumpReader(path) as r:
        names = [n for n in r.names() if flt is None or flt.search(n)]
        info = {n: (r.meta(n), tensor_stats(r.tensor(n)) if stats else None) for n in names}
        attrs = dict(r.attrs)
    if as_json:
        print(json.dumps({"path": path, "attrs": attrs, "tensors": {
            n: {"shape": list(m["shape"]), "dtype": m["dtype"], "order": m["order"], **(s or {})}
            for n, (m, s) in info.items()}}, ensure_ascii=False, default=str))
        return
    con = console()
    t = Table(title=f"{path}", show_header=False, box=None)
    for k, v in attrs.items():
        t.add_row(f"[dim]{k}[/dim]", str(v))
    con.print(t)
    tree = Tree(f"[bold]tensors[/bold] ({len(names)})")
    nodes: dict[str, Tree] = {}
    for n in names:
        parts = n.split(".")
        # group by step and by layer (layers.N as one level), leaves named by the rest
        head = []
        if parts[0].startswith("step"):
            head.append(parts.pop(0))
        if parts[0] == "layers" and len(parts) > 2:
            head.append(f"layers.{parts[1]}")
            parts = parts[2:]
        parent, key = tree, ""
        for h in head:
            key += h + "/"
            if key not in nodes:
                nodes[key] = parent.add(f"[bold magenta]{h}[/bold magenta]")
            parent = nodes[key]
        m, s = info[n]
        parent.add(_line(".".join(parts), m, s))
    con.print(tree)


def register(app: typer.Typer) -> None:
    app.command("show")(show_cmd)
