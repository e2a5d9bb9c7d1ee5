"""`deepinfer compare A.h5 B.h5`: pair two dumps by name (B is the reference) and find the first divergence.

Exit codes: 0 every compared tensor passes, 1 something fails, 2 a file is unreadable / not a dump / the
two runs cannot be paired (different models or prompts).
"""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.table import Table

from deepinfer.debug.compare import Report, Tol, Tolerances, compare_dumps, fmt
from deepinfer.outpath import atomic_write, check_output
from deepinfer_cli.console import console
from deepinfer_cli.errors import handle_errors

_STYLE = {"pass": "green", "fail": "bold red", "shape": "bold red", "skip": "dim", "only_a": "yellow",
          "only_b": "yellow"}


def render(rep: Report, con: Console, show_passing: bool = True) -> None:
    t = Table(title=f"A {rep.path_a}  vs  B (reference) {rep.path_b}", show_lines=False)
    for col in ("#", "name", "shape", "dtype A/B", "max|Δ|", "mean|Δ|", "rel_err", "cos", "ULP", "worst: A vs B",
                "NaN/Inf", "fail", "status"):
        t.add_column(col, justify="left" if col in ("name", "shape", "dtype A/B", "worst: A vs B", "status") else "right",
                     overflow="fold")
    first = rep.first_divergence
    for i, r in enumerate(rep.rows):
        if not show_passing and r.status == "pass":
            continue
        shape = str(list(r.shape_b or r.shape_a)) if r.shape_a == r.shape_b or not (r.shape_a and r.shape_b) \
            else f"{list(r.shape_a)} vs {list(r.shape_b)}"
        dt = r.dtype_a if r.dtype_a == r.dtype_b else f"{r.dtype_a or '-'}/{r.dtype_b or '-'}"
        if r.kind == "index" and r.overlap is not None:
            worst = f"overlap {r.overlap:.2f} (min {r.min_overlap:.2f})" + (f" {r.note}" if r.note else "")
        elif r.worst_index is not None:
            worst = f"{r.worst_index}: {fmt(r.worst_a)} vs {fmt(r.worst_b)}"
        else:
            worst = ""
        nonfin = f"{r.nan_a + r.inf_a}/{r.nan_b + r.inf_b}" if (r.nan_a or r.nan_b or r.inf_a or r.inf_b) else ""
        ulp = f"{r.max_ulp} {r.ulp_dtype}" if r.max_ulp is not None else ""
        status = r.status + (" ◀ first" if r is first else "")
        t.add_row(str(i), r.name, shape, dt, fmt(r.max_abs), fmt(r.mean_abs), fmt(r.rel_err), fmt(r.cosine, 6),
                  ulp, worst, nonfin, f"{r.fail_frac:.1%}" if r.status in ("pass", "fail") else "",
                  f"[{_STYLE.get(r.status, '')}]{status}[/]")
    con.print(t)
    for k, (va, vb) in rep.fingerprint_diff.items():
        con.print(f"[dim]differs:[/dim] {k}: A {va!r}  B {vb!r}", highlight=False)
    if rep.only_a:
        con.print(f"[yellow]only in A ({len(rep.only_a)}):[/yellow] {', '.join(rep.only_a[:10])}"
                  + (" ..." if len(rep.only_a) > 10 else ""), highlight=False)
    if rep.only_b:
        con.print(f"[yellow]only in B ({len(rep.only_b)}):[/yellow] {', '.join(rep.only_b[:10])}"
                  + (" ..." if len(rep.only_b) > 10 else ""), highlight=False)
    for w in rep.warnings:
        con.print(f"[yellow]warning:[/yellow] {w}", highlight=False)
    style = "green" if rep.passed else "bold red"
    con.print(f"[{style}]{rep.first_line()}[/{style}]  ({rep.n_failed} of {len(rep.compared)} fail)",
              highlight=False)


@handle_errors
def compare_cmd(
    a: str = typer.Argument(..., help="Dump under test (.h5)."),
    b: str = typer.Argument(..., help="Reference dump (.h5)."),
    rtol: float = typer.Option(1e-2, "--rtol", help="Relative tolerance (an element fails when |a-b| exceeds "
                               "both atol and rtol·|b|)."),
    atol: float = typer.Option(1e-3, "--atol", help="Absolute tolerance."),
    stat: str = typer.Option("elemwise", "--stat", help="elemwise (per element) | max | mean | median | quantile: "
                             "S(|a-b|) <= atol + rtol·S(|b|)."),
    quantile: float = typer.Option(0.99, "--quantile", help="The quantile for --stat quantile."),
    min_overlap: float = typer.Option(1.0, "--min-overlap", help="Index tensors: per-row set overlap needed to pass."),
    name_filter: str = typer.Option(None, "--filter", help="Only names matching this regex."),
    tolerances: str = typer.Option(None, "--tolerances", help="Per-name rules file (JSON or text; dumps/README.md)."),
    require_all: bool = typer.Option(False, "--require-all", help="Tensors present on one side only also fail."),
    failures_only: bool = typer.Option(False, "--failures-only", help="Table: hide passing rows."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON instead of a table."),
    report: str = typer.Option(None, "--report", help="Also write the JSON report to this file."),
):
    """Compare two dumps tensor by tensor (B is the reference) and name the first tensor that fails.

    Example: deepinfer compare dumps/h200.h5 dumps/cpu-ref.h5 --rtol 2e-2 --atol 1e-2
    """
    if report:
        check_output(report, "--report", inputs=(a, b, tolerances))
    default = Tol(rtol=rtol, atol=atol, stat=stat, quantile=quantile, min_overlap=min_overlap).check()
    tols = Tolerances.load(tolerances, default) if tolerances else Tolerances(default)
    rep = compare_dumps(a, b, tols, name_filter, require_all)
    data = rep.to_dict()
    if report:
        atomic_write(report, json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    if as_json:
        print(json.dumps(data, ensure_ascii=False))
    else:
        render(rep, console(), show_passing=not failures_only)
    if not rep.passed:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("compare")(compare_cmd)
