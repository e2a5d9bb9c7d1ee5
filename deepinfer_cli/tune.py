"""`deepinfer tune`: time every installed backend's kernel per op and phase, keep the correct ones, write the map."""

from __future__ import annotations

import json
import shlex
import sys

import typer
from rich.console import Console
from rich.table import Table

from deepinfer.outpath import check_output
from deepinfer_cli.console import console
from deepinfer_cli.errors import handle_errors


@handle_errors
def tune_cmd(
    out: str = typer.Option(..., "--out", "-o", help="Where to write the tuned op map (YAML), for `--op @FILE`."),
    baseline: str = typer.Option("triton", "--baseline", help="The backend that keeps an op unless another is "
                                 "measured faster."),
    candidates: str = typer.Option(None, "--candidates", help="Backends to try, comma-separated (default: every "
                                   "one importable here, the torch reference included)."),
    ops_regex: str = typer.Option(None, "--ops", help="Only the ops matching this regular expression."),
    shapes: str = typer.Option("flash", "--shapes", help="The `ab` shape set: flash | pro (CUDA) | tiny."),
    policy: str = typer.Option("official", "--policy", help="official: only kernels that accumulate as the official "
                               "ones; fast: also those that promote FP8 sums once per 128-K block (cuBLASLt, FlagGems, "
                               "DeepGEMM), each candidate's drift recorded (a fast map runs under DEEPINFER_POLICY=fast)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the cases' inputs."),
    device: str = typer.Option(None, "--device", help="cuda | cuda:N | cpu (default: cuda when available)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
):
    """Measure each op's kernels on this GPU (every `ab` case of the decode and prefill phases), keep those that
    pass against the reference, and write the fastest per op and phase as a map that `--op @FILE` reads here
    (and refuses on another GPU, backend set or policy). Exit 0, or 2 on bad input.

    Example: deepinfer tune -o h200.yaml && deepinfer bench --preset flash-slice:4 --op @h200.yaml --device cuda
    """
    from deepinfer.debug.tune import measured, tune, write_map

    if device:  # refused before anything is measured
        from deepinfer.engine.loader import resolve_device

        resolve_device(device)
    check_output(out, "--out")
    err = Console(stderr=True) if not as_json else None
    cands = [c.strip() for c in candidates.split(",") if c.strip()] if candidates else None
    res = tune(baseline, cands, ops_regex, shapes, seed, device, policy,
               progress=None if err is None else (lambda op, ph, b: err.print(f"[dim]{op} {ph}: {b}[/dim]")))
    write_map(out, res, shlex.join(["deepinfer", "tune", *sys.argv[2:]]))
    timed = any(c.ms is not None for ch in res["choices"] for c in ch.candidates.values())
    if as_json:
        print(json.dumps({"out": out, "ops": res["ops"], "timed": timed, "baseline": baseline, "policy": policy,
                          "candidates": res["candidates"], "device": res["device"], "measured": measured(res)}))
        return
    t = Table(title=f"tuned on {res['device']} ({res['shapes']} shapes, {policy} policy; ms summed over each phase's "
                    "cases, and the worst relative error against the reference)")
    for col in ("op", "phase", "choice", *res["candidates"]):
        t.add_column(col, justify="right" if col in res["candidates"] else "left")
    for ch in res["choices"]:
        def cell(c) -> str:
            drift = f" ({c.drift:.1e})" if c.drift is not None else ""
            if c.eligible:
                return (f"{c.ms:.3f}" if c.ms is not None else "ok") + drift
            return f"[dim]{c.reason[:40]}[/dim]"
        cells = [cell(ch.candidates[b]) for b in res["candidates"]]
        t.add_row(ch.op, ch.phase, ch.backend, *cells)
    console().print(t)
    if not timed:
        console().print("nothing was timed (timings need CUDA): every op keeps the baseline where it passes",
                        highlight=False)
    console().print(f"wrote {out}: use it with --op @{out}", highlight=False)


def register(app: typer.Typer) -> None:
    app.command("tune")(tune_cmd)
