"""`deepinfer probe`: what this machine can run — kernel coverage, Triton/FlagTree, FlagGems, TileLang, env."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from deepinfer_cli.console import console
from deepinfer_cli.errors import handle_errors

probe_app = typer.Typer(name="probe", help="Probe kernel coverage, compilers and the environment.",
                        no_args_is_help=True, add_completion=False, rich_markup_mode="rich")

JSON = typer.Option(False, "--json", help="Print one JSON object.")
_STYLE = {"pass": "green", "fail": "bold red", "skip": "yellow", "info": "cyan"}


def _status(s: str) -> str:
    return f"[{_STYLE.get(s, '')}]{s.upper()}[/]"


def _esc(s) -> str:
    return str(s).replace("[", "\\[")


def _emit(d: dict, as_json: bool, render) -> None:
    if as_json:
        print(json.dumps(d, default=str))
    else:
        render(d, console())


def _value(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def _checks_table(title: str, rows: list[dict]) -> Table:
    t = Table(title=title)
    for c in ("check", "result", "value", "detail"):
        t.add_column(c, overflow="fold")
    for r in rows:
        t.add_row(r["check"], _status(r["status"]), _value(r.get("value")), _esc(r.get("detail", "")))
    return t


# ----------------------------------------------------------------------------------------- kernels
@probe_app.command("kernels")
@handle_errors
def kernels_cmd(as_json: bool = JSON, op_map: str = typer.Option(None, "--op", help="Per-op backends to show "
                                                                   "as a run would use them (default: $DEEPINFER_OPS).")):
    """Coverage matrix op x backend: implemented, importable here, and used or falling back here."""
    from deepinfer.debug.probes import probe_kernels

    _emit(probe_kernels(op_map), as_json, _render_kernels)


def _render_kernels(d: dict, con: Console) -> None:
    bk = list(d["backends"])
    omap = f", --op {d['op_map']}" if d.get("op_map") else ""
    t = Table(title=f"kernel coverage · a run here uses backend {d['default_backend']}{omap} ({d['device']})")
    t.add_column("op")
    for b in bk:
        t.add_column(b)
    t.add_column(f"here ({d['default_backend']})")
    for row in d["ops"]:
        cells = []
        for b in bk:
            c = row["backends"][b]
            if c["registered"]:
                cells.append("[green]yes[/]")
            elif c.get("reference_by_design"):
                cells.append("[cyan]reference[/]")
            elif c["implemented"]:
                cells.append("[yellow]source only[/]")
            else:
                cells.append("-")
        here = row["here"] + (f" ({row['backend_here']})" if row["backend_here"] != d["default_backend"] else "")
        cells.append(f"[green]{here}[/]" if row["here"] in ("used", "reference (by design)") else f"[yellow]{here}[/]")
        t.add_row(row["op"], *cells)
    con.print(t)
    for b in bk:
        why = {r["op"]: r["backends"][b]["reference_by_design"] for r in d["ops"]
               if r["backends"][b].get("reference_by_design")}
        if why:
            con.print(f"{b} leaves {len(why)} op(s) to the reference by design: "
                      + "; ".join(f"{op}: {w}" for op, w in why.items()), highlight=False)
    for b, info in d["backends"].items():
        state = "importable" if info["importable"] else f"not importable: {escape(info['reason'])}"
        n = len(info["registered"]) or len(info["in_source"])
        con.print(f"{b}: {state}; {n} op(s) implemented", highlight=False)


# ------------------------------------------------------------------------------------------ triton
def _triton(as_json: bool):
    from deepinfer.debug.probes import probe_triton

    d = probe_triton()
    _emit(d, as_json, _render_triton)
    if not d["ok"]:
        raise typer.Exit(1)


@probe_app.command("triton")
@handle_errors
def triton_cmd(as_json: bool = JSON):
    """Installed Triton (upstream or FlagTree) and the features the engine relies on, incl. an SM90 compile.

    Numeric checks run on the GPU, or under the Triton interpreter when there is none. Exit 1 if a check fails.
    """
    _triton(as_json)


@probe_app.command("flagtree", hidden=False)
@handle_errors
def flagtree_cmd(as_json: bool = JSON):
    """Alias of `probe triton` (FlagTree installs as the `triton` package)."""
    _triton(as_json)


def _render_triton(d: dict, con: Console) -> None:
    i = d["install"]
    if not i["installed"]:
        con.print("[bold red]triton is not installed[/]")
    else:
        tag = f", backend tag {i['backend_tag']}" if i.get("backend_tag") else ""
        con.print(f"triton {i['version']} ({i['flavor']}, distribution {i['distribution']}{tag}) at {i['path']}; "
                  f"GPU backends: {', '.join(i['gpu_backends']) or '-'}", highlight=False)
    if d.get("interpreter"):
        con.print("no CUDA device: numeric checks ran under the Triton interpreter (TRITON_INTERPRET=1)")
    con.print(_checks_table("Triton features", d["checks"]))
    con.print("[green]all checks passed[/]" if d["ok"] else "[bold red]some checks failed[/]")


# ---------------------------------------------------------------------------------------- flaggems
@probe_app.command("flaggems")
@handle_errors
def flaggems_cmd(include: str = typer.Option(None, "--include", help="Comma-separated op names to enable "
                                             "(default: every op with a test input here)."),
                 screen: bool = typer.Option(False, "--screen", help="Record the ATen ops the model calls (a "
                                             "prefill + --steps decode steps), check each one FlagGems registers "
                                             "on exactly those inputs (a worker process, --budget s each), write "
                                             "the allow-list (--out), then run the model with it."),
                 model: str = typer.Option(None, "--model", "-m", help="--screen: checkpoint directory "
                                           "(default: the embedded deepinfer-tiny)."),
                 out: str = typer.Option(None, "--out", help="--screen: write the allow-list here (only_enable "
                                         "YAML; use it as --flaggems @FILE)."),
                 backend: str = typer.Option(None, "--backend", help="--screen: the kernel backend the model "
                                             "runs on while recording (its ATen calls depend on it)."),
                 device: str = typer.Option(None, "--device", help="--screen: cuda | cuda:N."),
                 steps: int = typer.Option(3, "--steps", help="--screen: greedy decode steps after the prefill."),
                 budget: float = typer.Option(120.0, "--budget", help="--screen: seconds per op, compile included "
                                              "(past it: too_slow, and the worker is replaced)."),
                 per_op: int = typer.Option(3, "--per-op", help="--screen: distinct call signatures checked per "
                                            "ATen op (the first ones the model calls: prefill, then decode)."),
                 deadline: float = typer.Option(None, "--deadline", help="--screen: seconds for all checks; those "
                                                "not started by then are not_checked."),
                 as_json: bool = JSON):
    """FlagGems: resolve op names, enable only those, check each registered op against PyTorch; --screen: the
    allow-list from the model's own ATen calls."""
    if screen:
        from deepinfer.debug.flaggems_screen import run_screen

        err = Console(stderr=True)
        d = run_screen(model, backend, device, steps=steps, budget=budget, out=out, per_op=per_op,
                       deadline=deadline,
                       log=(lambda m: None) if as_json else (lambda m: err.print(m, highlight=False)))
        _emit(d, as_json, _render_screen)
        return
    from deepinfer_cli.errors import refuse_given

    refuse_given((("--model", model is not None), ("--out", out is not None), ("--backend", backend is not None),
                  ("--device", device is not None), ("--steps", steps != 3), ("--budget", budget != 120.0),
                  ("--per-op", per_op != 3), ("--deadline", deadline is not None)),
                 ": options of `probe flaggems --screen`; add --screen or leave them out")  # ignored without it
    from deepinfer.debug.probes import probe_flaggems

    names = [n.strip() for n in include.split(",") if n.strip()] if include else None
    d = probe_flaggems(names)
    if names and d.get("unresolved"):  # a name asked for that FlagGems does not know: bad input, one line
        from deepinfer_cli.errors import UserError

        hints = "; ".join(f"{n} (close: {', '.join(c) or 'none'})" for n, c in d["unresolved"].items())
        raise UserError(f"--include: not in FlagGems' registration table: {hints}")
    _emit(d, as_json, _render_flaggems)
    if not d["ok"]:
        raise typer.Exit(1)


def _render_flaggems(d: dict, con: Console) -> None:
    if d["installed"]:
        con.print(f"flag_gems {d['version']}; enabled via {d.get('enable', '-')}; registered: "
                  f"{', '.join(d['registered']) or '-'}", highlight=False)
        for n, close in d["unresolved"].items():
            con.print(f"unresolved: {n}" + (f" (close: {', '.join(close)})" if close else ""), highlight=False)
    con.print(_checks_table("FlagGems", d["rows"]))


def _render_screen(d: dict, con: Console) -> None:
    t = Table(title=f"FlagGems {d['flag_gems_version']} screen: {d['ops_recorded']} ATen ops, {d['signatures']} "
                    f"call signatures ({d['backend']})")
    for c in ("op", "function", "calls", "status", "detail"):
        t.add_column(c, overflow="fold")
    for v in d["verdicts"]:
        if v["status"] == "not_registered" and v.get("function") is None:
            continue
        t.add_row(v["key"], v.get("function") or "-", str(v["count"]), v["status"], v.get("detail", ""))
    con.print(t)
    con.print(", ".join(f"{k} {n}" for k, n in d["counts"].items() if n), highlight=False)
    con.print(f"allowed ({len(d['allowed'])}): {', '.join(d['allowed']) or '-'}" +
              (f"; written to {d['out']}" if d["out"] else ""), highlight=False)
    if "tokens_with" in d:
        same = "token-identical" if d["token_identical"] else f"first divergence at token {d['first_divergence']}"
        con.print(f"with the allow-list: {same} vs without; {'deterministic' if d['deterministic'] else 'NOT deterministic'}"
                  " over two runs", highlight=False)
    else:
        con.print(f"with the allow-list: {d.get('with_allow_list', '-')}", highlight=False)


# ---------------------------------------------------------------------------------------- tilelang
@probe_app.command("tilelang")
@handle_errors
def tilelang_cmd(as_json: bool = JSON):
    """TileLang: version, TileKernels version, import, the CUDA arch, and a small kernel compiled and run (CUDA)."""
    from deepinfer.debug.probes import probe_tilelang

    d = probe_tilelang()
    title = f"TileLang {d['version'] or ''}".strip() + (f" · {d['arch']}" if d["arch"] else "")
    _emit(d, as_json, lambda d, con: con.print(_checks_table(title, d["rows"])))
    if not d["ok"]:
        raise typer.Exit(1)


# --------------------------------------------------------------------------------------------- env
@probe_app.command("env")
@handle_errors
def env_cmd(as_json: bool = JSON):
    """GPUs, driver, CUDA, package versions (not imported), /dev/infiniband and expert-parallel transports, py-spy."""
    from deepinfer.debug.probes import probe_env

    _emit(probe_env(), as_json, _render_env)


def _render_env(d: dict, con: Console) -> None:
    t = Table(title="environment", show_header=False)
    t.add_column("key")
    t.add_column("value", overflow="fold")
    gpus = "; ".join(f"{g['index']}: {g['name']} sm_{g['capability'].replace('.', '')} {g['memory_gib']} GiB"
                     for g in d["gpus"]) or "none (CUDA not available)"
    t.add_row("GPUs", gpus)
    t.add_row("driver", d["driver"] or "-")
    t.add_row("CUDA (torch)", d["cuda_runtime"] or "-")
    for k, v in d["packages"].items():
        t.add_row(k, v or "[yellow]not installed[/]")
    t.add_row("/dev/infiniband", "present" if d["infiniband"] else "absent")
    t.add_row("expert parallel", d["expert_parallel"])
    t.add_row("py-spy", f"{d['py_spy']} ({d['py_spy_version']})" if d["py_spy"] else "[yellow]not installed[/] "
              "(`deepinfer stack` needs it)")
    t.add_row("default backend", d["default_backend"])
    con.print(t)


# ----------------------------------------------------------------------------------------- requant
@probe_app.command("requant")
@handle_errors
def requant_cmd(model: str = typer.Option(None, "--model", "-m", help="Checkpoint directory or preset:NAME "
                                          "(default: the embedded deepinfer-tiny)."), as_json: bool = JSON):
    """The FP4 routed experts requantised to FP8 per 128 x 128 block (what DeepGEMM's SM90 GEMMs take): per layer
    and projection, the blocks and values that change and the error. Exit 0 (lossless or measured), 2 bad input."""
    from deepinfer.debug.probes import probe_requant

    _emit(probe_requant(model, progress=not as_json), as_json, _render_requant)


def _render_requant(d: dict, con: Console) -> None:
    t = Table(title=f"FP4 experts -> per-128 FP8 ({d['model']})")
    for c in ("tensor", "experts", "blocks", "lossy blocks", "lossy values", "max |err|", "rel err", "span 2^"):
        t.add_column(c, justify="left" if c == "tensor" else "right")
    for r in d["tensors"]:
        t.add_row(r["name"], str(r["experts"]), str(r["blocks"]), str(r["lossy_blocks"]), str(r["lossy_values"]),
                  f"{r['max_abs_err']:.3g}", f"{r['rel_err']:.3g}", str(r["max_span_log2"]))
    con.print(t)
    if not d["tensors"]:
        con.print("no FP4 routed experts in this checkpoint", highlight=False)
    elif d["lossless"]:
        con.print(f"lossless: every 128 x 128 block's group scales lie within 2^14 ({len(d['tensors'])} tensors)",
                  highlight=False)
    else:
        w = d["worst"]
        con.print(f"{d['lossy_tensors']} of {len(d['tensors'])} tensors change; worst {w['name']}: rel err "
                  f"{w['rel_err']:.3g}, max |err| {w['max_abs_err']:.3g}", highlight=False)


def register(app: typer.Typer) -> None:
    app.add_typer(probe_app, name="probe")
