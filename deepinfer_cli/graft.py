"""`deepinfer graft`: each local layer on a reference dump's inputs to it; the error each layer adds alone."""

from __future__ import annotations

import json

import typer
from rich.table import Table

from deepinfer.debug.dumper import parse_layers
from deepinfer.debug.graft import graft
from deepinfer.debug.h5schema import DumpReader
from deepinfer_cli import common
from deepinfer_cli.console import console
from deepinfer_cli.errors import handle_errors


@handle_errors
def graft_cmd(
    ref: str = typer.Option(..., "--ref", help="Reference dump (.h5, `deepinfer dump`, from any host)."),
    model: str = common.MODEL,
    backend: str = common.BACKEND,
    strict: bool = common.STRICT,
    op_map: str = common.OPS,
    numerics: str = typer.Option(None, "--numerics", help="official | exact (default: the dump's)."),
    dtype: str = typer.Option(None, "--dtype", help="bfloat16 | float32 | float16 (default: the dump's)."),
    device: str = common.DEVICE,
    layers: str = typer.Option(None, "--layers", help="Layers to graft: all | N-M | N,M,... (default: every "
                               "layer the dump holds)."),
    tol: float = typer.Option(1e-2, "--tol", help="A layer whose own relative error exceeds this is where the "
                              "divergence is born (exit 1)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of the table."),
):
    """Run each layer of this configuration on the reference dump's input streams to that layer (prompt, then
    its decode steps) and compare its output with the dump's: the error each layer adds on its own, apart
    from what it inherits. Exit 0 when every layer is within --tol, 1 naming the first that is not, 2 on
    bad input.

    Example: deepinfer graft --ref dumps/hostA.h5 --backend triton
    """
    if not (tol > 0):
        raise ValueError(f"--tol {tol}: must be positive")
    with DumpReader(ref) as d:
        lm = common.setup(model, backend, strict, numerics or str(d.attrs.get("numerics", "official")),
                          dtype or str(d.attrs.get("dtype", "bfloat16")), device, progress=not as_json,
                          op_map=op_map)
        sel = parse_layers(None, layers, lm.cfg.n_layers) if layers else None
        res = graft(lm.model, d, sel, tol)
    if as_json:
        print(json.dumps(res.to_dict()))
    else:
        con = console()
        t = Table(title=f"graft · {ref} · {res.steps} decode step(s)")
        for col in ("layer", "prefill rel_err", "decode rel_err (worst)", "step", ""):
            t.add_column(col)
        fo = res.first_over
        for e in res.layers:
            mark = "[red]born here[/red]" if fo is not None and e.layer == fo.layer else ""
            t.add_row(str(e.layer), f"{e.prefill:.2e}", "-" if e.decode is None else f"{e.decode:.2e}",
                      "-" if e.worst_step is None else str(e.worst_step), mark)
        con.print(t)
        con.print("every layer within --tol %g" % tol if fo is None else
                  f"first layer over --tol {tol:g}: {fo.layer}", highlight=False)
    if res.first_over is not None:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("graft")(graft_cmd)
