"""`deepinfer margin`: does the test configuration change an answer? Top-1 agreement and margins per position."""

from __future__ import annotations

import json
from typing import Optional, Tuple

import typer
from rich.console import Console
from rich.table import Table

from deepinfer.debug.margin import (DEFAULT_REF, DEFAULT_TEST, DEFAULT_TOL, MarginResult, check_thresholds,
                                    from_dumps, parse_spec, plot, run_margin, sparkline)
from deepinfer.outpath import check_output
from deepinfer_cli import common
from deepinfer_cli.console import console
from deepinfer_cli.errors import UserError, handle_errors, refuse_given


def render(res: MarginResult, con: Console, token_text=None) -> None:
    s = res.summary()
    t = Table(title=f"ref {res.ref}  ·  test {res.test}")
    for col in ("pos", "ref top-1", "test top-1", "ref margin", "test margin", "Δmargin", "logits rel_err", ""):
        t.add_column(col, justify="left" if col in ("ref top-1", "test top-1", "") else "right")
    for p in res.positions:
        tt = (lambda i: f"{i} {token_text(i)!r}") if token_text else str
        mark = "" if p.agree else f"[red]✗ {p.label}[/red]"
        if not p.forced:
            mark += " [dim](inputs differ)[/dim]"
        t.add_row(str(p.pos), tt(p.ref_token), tt(p.test_token), f"{p.ref_margin:.3f}", f"{p.test_margin:.3f}",
                  f"{p.delta:+.3f}", f"{p.logits_rel_err:.2e}", mark)
    con.print(t)
    con.print("Δmargin " + sparkline([p.delta for p in res.positions], [not p.agree for p in res.positions]),
              highlight=False)
    fd = s["first_disagreement"]
    con.print(f"agreement {s['agreement']:.1%} ({res.n - len(s['disagreements'])}/{res.n}); first disagreement: "
              f"{'none' if fd is None else f'pos {fd}'}; Δmargin mean {s['delta_mean']:+.3f} std {s['delta_std']:.3f}; "
              f"noise band {s['noise_band']:.3f} (from {s['band_source']}); near-ties {s['near_ties']}, "
              f"divergences {s['divergences']}", highlight=False)
    style = {"agree": "green", "near-ties": "yellow"}.get(s["verdict"], "bold red")
    off = (f"; logits far off at {s['logits_off']} position(s): relative error up to "
           f"{s['max_logits_rel_err']:.2f} > --tol {s['tol']:g}") if s["logits_off"] else ""
    con.print(f"[{style}]verdict: {s['verdict']}[/{style}]{off}", highlight=False)


@handle_errors
def margin_cmd(
    prompt: str = typer.Argument(None, help="Prompt text, or - to read it from stdin (not with --from-dumps)."),
    model: str = common.MODEL,
    steps: int = typer.Option(16, "--steps", "-n", help="Greedy positions to compare (prefill + steps-1 decodes)."),
    ref: str = typer.Option(DEFAULT_REF, "--ref", help="Reference SPEC: backend=,numerics=,dtype=,device=,kv=bf16|fp8,op.NAME=BACKEND."),
    test: str = typer.Option(DEFAULT_TEST, "--test", help="Test SPEC (teacher-forced on the reference's tokens)."),
    k: float = typer.Option(2.0, "--k", help="Noise band multiplier: k·std(Δmargin) of the reference's noise "
                            "run, and k·√2·u·max|logit| for the logits' rounding."),
    tol: float = typer.Option(DEFAULT_TOL, "--tol", help="Logits relative error beyond which a position is "
                              "far off, so the run is divergent whatever its margins."),
    band: float = typer.Option(None, "--band", help="Noise band in logits (near-tie: ref margin <= band), "
                               "instead of the measured one."),
    noise: bool = typer.Option(True, "--noise/--no-noise", help="Run the reference once more in the test's "
                               "dtype (or the other 16-bit dtype) to measure its own noise for the band."),
    dumps: Optional[Tuple[str, str]] = typer.Option(None, "--from-dumps", help="TEST.h5 REF.h5 made with "
                                                     "dump --steps (REF second, as in compare)."),
    chat: bool = typer.Option(False, "--chat", help="V4 chat layout around the prompt."),
    plot_path: str = typer.Option(None, "--plot", help="Write a PNG of both margin curves and Δmargin."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of the table."),
):
    """Top-1 agreement and logit margins of a test configuration against a reference, position by position.
    Exit code 0 when they agree or differ only at near-ties, 1 when divergent (a flip outside the noise band,
    or logits far off), 2 on bad input.

    Example: deepinfer margin "北京是" --steps 16 --ref numerics=exact,dtype=float32 --test numerics=official,dtype=bfloat16
    """
    check_thresholds(k, tol, band)
    if dumps and prompt is not None:
        raise UserError(f"a prompt ({prompt!r}) and --from-dumps: the dumps carry their own prompt; give one or "
                        "the other")
    if dumps:  # the dumps fix the prompt, the steps and both configurations: these would be ignored
        refuse_given((("--model", model is not None), ("--steps", steps != 16), ("--ref", ref != DEFAULT_REF),
                      ("--test", test != DEFAULT_TEST), ("--no-noise", not noise), ("--chat", chat)),
                     " with --from-dumps: the two dumps already hold their prompt, steps and configurations (dump "
                     "--steps makes them); leave them out")
    if plot_path:
        check_output(plot_path, "--plot", inputs=tuple(dumps or ()) + (model,))
    token_text = None
    if dumps:
        res, _ = from_dumps(dumps[0], dumps[1], k, tol, band)
    else:
        text = common.read_prompt(prompt)
        common.check_prompt(text, "chat" if chat else "raw")
        rs, ts = parse_spec(ref, "--ref"), parse_spec(test, "--test")
        from deepinfer.engine.loader import preset_name, resolve_device

        common.check_spec_here("--ref", ref, rs)
        common.check_spec_here("--test", test, ts)

        if preset_name(model) is not None and resolve_device(rs["device"]) != resolve_device(ts["device"]):
            raise ValueError(f"--model {model}: random weights are generated per device type, so --ref and --test "
                             "must name the same device to compare one set of weights")
        # The reference loads first: its tokenizer encodes the prompt, and run_margin reuses it.
        ref_lm = common.setup_spec(model, rs, progress=not as_json)
        ids = ref_lm.tokenizer.encode_prompt(text, "chat" if chat else "raw")

        def load(spec):
            if spec is rs:
                return ref_lm.model
            return common.setup_spec(model, spec, progress=not as_json).model

        res, _ = run_margin(ids, steps, rs, ts, load, k, tol, band, noise)
        token_text = ref_lm.tokenizer.token_text
    if plot_path:
        plot(res, plot_path)
    if as_json:
        print(json.dumps(res.to_dict(), ensure_ascii=False))
    else:
        con = console()
        render(res, con, token_text)
        if plot_path:
            con.print(f"plot: {plot_path}", highlight=False)
    if res.verdict == "divergent":
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("margin")(margin_cmd)

