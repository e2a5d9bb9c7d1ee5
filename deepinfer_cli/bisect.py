"""`deepinfer bisect`: the minimal set of op sites (op, layer) whose test implementation makes a run diverge."""

from __future__ import annotations

import json

import typer
from rich.table import Table

from deepinfer.debug.bisect import backend_impls, bisect, bisect_numerics, check_no_split, parse_metric
from deepinfer.debug.margin import parse_spec, spec_str
from deepinfer.engine.loader import resolve_device
from deepinfer.model.numerics import Numerics
from deepinfer.ops.registry import check_runs_on
from deepinfer_cli import common
from deepinfer_cli.console import console
from deepinfer_cli.errors import handle_errors


@handle_errors
def bisect_cmd(
    prompt: str = typer.Argument(..., help="Prompt text, or - to read it from stdin."),
    model: str = common.MODEL,
    ref: str = typer.Option("backend=torch", "--ref", help="Reference SPEC: backend=,numerics=,dtype=,device=,kv=bf16|fp8,experts=fp4|fp8,"
                             "op.NAME=BACKEND."),
    test: str = typer.Option("backend=triton", "--test", help="Test SPEC: the same dtype and device; another "
                             "backend (op sites), other numerics, another kv= or experts= (layer sites): one axis."),
    steps: int = typer.Option(8, "--steps", "-k", help="Greedy positions compared (prefill + steps-1 decodes)."),
    metric: str = typer.Option("tokens", "--metric", help="tokens (greedy tokens differ) | logits[:rtol] "
                               "(teacher-forced logits beyond rtol relative, default 1e-3)."),
    chat: bool = typer.Option(False, "--chat", help="V4 chat layout around the prompt."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of the table."),
):
    """Delta debugging over sites: which op at which layer, swapped from the reference's backend to the
    test's (op sites), or which layers, switched to the test's numerics (layer sites: e.g. --ref
    numerics=exact --test numerics=official) or KV format (--ref kv=bf16 --test kv=fp8), make the tokens (or
    logits) diverge. Exit 0 when reference
    and test agree, 1 when culprits were found, 2 on bad input.

    Example: deepinfer bisect "北京是" --ref backend=torch --test backend=triton --steps 8
    """
    parse_metric(metric)
    if steps < 1:
        raise ValueError(f"--steps {steps}: must be at least 1")
    rs, ts = parse_spec(ref, "--ref"), parse_spec(test, "--test")
    common.check_spec_here("--ref", ref, rs)
    common.check_spec_here("--test", test, ts)
    for k in ("dtype", "device"):
        if (rs.get(k) or None) != (ts.get(k) or None):
            raise ValueError(f"--ref and --test differ in {k} ({rs.get(k)} / {ts.get(k)}): bisect switches "
                             "sites of one compute dtype and device; give both the same")
    by_experts = (rs.get("experts") or "fp4") != (ts.get("experts") or "fp4")  # FP4 as stored / requantised
    rn, tn = (Numerics.parse(s["numerics"], kv_qat=None if s["kv"] is None else s["kv"] == "fp8") for s in (rs, ts))
    by_numerics = (rn.mode, rn.release) != (tn.mode, tn.release)  # official against official@efc85512 too
    by_kv = not by_numerics and rn.kv_qat != tn.kv_qat  # the forms compared, whether named or the release's
    axes = [n for n, d in (("numerics", by_numerics), ("kv", by_kv), ("experts", by_experts),
                           ("backend", (rs["backend"] or None) != (ts["backend"] or None) or rs["ops"] != ts["ops"]))
            if d]
    if len(axes) > 1:
        raise ValueError(f"--ref and --test differ in {' and '.join(axes)}: bisect one axis at a time")
    text = common.read_prompt(prompt)
    common.check_prompt(text, "chat" if chat else "raw")
    test_backend = ts["backend"] or "torch"
    layers = by_numerics or by_kv or by_experts
    if not layers:  # before any load: the test's backends must run here
        check_no_split(ts["ops"])
        for b in {test_backend, *ts["ops"].values()}:
            check_runs_on(b, resolve_device(rs["device"]), rs["dtype"], "--test backend")
        impl = backend_impls(test_backend, ts["ops"])
    lm = common.setup_spec(model, rs, progress=not as_json)
    ids = lm.tokenizer.encode_prompt(text, "chat" if chat else "raw")
    if layers:  # layer sites: the test's numerics, KV format or experts' form per layer (blocks of a second model)
        tm = common.setup_spec(model, ts, progress=not as_json)
        res = bisect_numerics(lm.model, tm.model, ids, steps, metric, spec_str(rs), spec_str(ts), rs["dtype"],
                              site="kv_format" if by_kv else "experts" if by_experts else "numerics")
    else:
        res = bisect(lm.model, ids, steps, metric, impl, spec_str(rs), spec_str(ts), rs["dtype"])
    if as_json:
        print(json.dumps(res.to_dict(), ensure_ascii=False))
    else:
        con = console()
        if res.agree:
            con.print(f"[green]agree[/green]: {res.test} against {res.ref}, {res.steps} positions by {res.metric} "
                      f"({res.sites} sites, {res.runs} runs)", highlight=False)
        else:
            t = Table(title=f"bisect · ref {res.ref} · test {res.test} · {res.metric}")
            for col in ("op", "layer", "first position", "logits rel_err", "ref margin", "near-tie"):
                t.add_column(col)
            for c in res.culprits:
                t.add_row(c.op, "-" if c.layer is None else str(c.layer), "-" if c.position is None else str(c.position),
                          f"{c.logits_rel_err:.2e}", "-" if c.ref_margin is None else f"{c.ref_margin:.3f}",
                          "-" if c.near_tie is None else ("yes" if c.near_tie else "no"))
            con.print(t)
            con.print(f"{len(res.culprits)} culprit(s) of {res.sites} sites in {res.runs} runs"
                      + (f"; {res.note}" if res.note else ""), highlight=False)
    if not res.agree:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("bisect")(bisect_cmd)
