"""`deepinfer ab`: A/B-test a kernel backend op by op against the reference (or saved outputs)."""

from __future__ import annotations

import json
import os
import sys

import typer
from rich.console import Console
from rich.table import Table

from deepinfer import settings
from deepinfer.outpath import check_output_dir
from deepinfer_cli.console import console
from deepinfer_cli.errors import UserError, handle_errors, refuse_given


def _prepare_interpreter(backend: str, compare: bool) -> str | None:
    """On a machine without CUDA, the Triton backend runs under the interpreter: TRITON_INTERPRET=1 must be
    in the environment before triton is imported. Returns a note for the output, or None."""
    if backend != "triton":
        return None
    import torch

    if torch.cuda.is_available():
        return None
    if settings.triton_interpreted():
        return "no CUDA device: Triton kernels run under the Triton interpreter (TRITON_INTERPRET=1, set by the caller)"
    if "triton" in sys.modules:
        raise UserError("no CUDA device and triton was already imported without TRITON_INTERPRET=1, so its "
                        "interpreter cannot be switched on; run `TRITON_INTERPRET=1 deepinfer ab --backend triton`")
    os.environ["TRITON_INTERPRET"] = "1"
    return "no CUDA device: set TRITON_INTERPRET=1, Triton kernels run under the Triton interpreter on CPU tensors"


def _fmt(x, spec=".2e") -> str:
    return "-" if x is None else format(x, spec)


@handle_errors
def ab_cmd(
    backend: str = typer.Option("triton", "--backend", help="Backend under test: triton | tilelang | flaggems | deepgemm (subsets: `deepinfer probe kernels`) | torch."),
    ref: str = typer.Option("torch", "--ref", help="Reference backend (torch = the plain-PyTorch spec)."),
    against: str = typer.Option(None, "--against", help="A peer backend (e.g. triton for --backend tilelang): "
                                "each case also runs there, judged against the same reference; with --bench "
                                "both are timed in the same run and the ratio is printed."),
    ops_regex: str = typer.Option(None, "--ops", help="Only ops whose name matches this regular expression."),
    shapes: str = typer.Option("all", "--shapes", help="tiny | flash | pro | all (comma-separated). Flash/Pro "
                               "shapes need CUDA; without it they are reported skipped."),
    seed: int = typer.Option(None, "--seed", help="Input seed (default: fresh random inputs, seed printed)."),
    dump: str = typer.Option(None, "--dump", help="Write each case's inputs and outputs to DIR (HDF5, one file per case)."),
    compare: str = typer.Option(None, "--compare", help="Run the backend on the inputs saved in DIR (by --dump on "
                                "another host) and compare with the saved outputs; no reference needed."),
    do_bench: bool = typer.Option(False, "--bench", help="Also time each case (CUDA only): GB/s, TFLOP/s and the fraction of the measured roofline."),
    device: str = typer.Option(None, "--device", help="cuda | cpu (default: cuda when available)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
):
    """Compare every op a backend implements with the reference, at tiny / V4-Flash / V4-Pro shapes.

    Exit code 1 when any case fails. Examples:

      deepinfer ab --backend triton --shapes tiny
      deepinfer ab --backend triton --ops 'gemm|quant' --bench
      deepinfer ab --backend tilelang --against triton --bench
      deepinfer ab --backend flaggems --against tilelang --bench
      deepinfer ab --backend deepgemm --against triton --ops gemm --shapes flash --bench
      deepinfer ab --backend torch --dump cases/      # on host A
      deepinfer ab --backend triton --compare cases/  # on host B
    """
    if dump and compare:
        raise UserError("--dump and --compare are exclusive")
    if against and compare:
        raise UserError("--against and --compare are exclusive (a replay runs one backend on saved cases)")
    if compare:  # a replay takes the saved cases' shapes, seed and reference outputs: these would be ignored
        refuse_given((("--shapes", shapes != "all"), ("--seed", seed is not None), ("--ref", ref != "torch")),
                     f" with --compare: a replay runs the cases saved in {compare} as they were dumped (their shapes, "
                     "inputs and reference outputs); leave them out")
    from deepinfer.ops.registry import BACKENDS

    if against and against not in BACKENDS:
        raise UserError(f"--against {against!r}: choose one of {', '.join(BACKENDS)}")
    if device:  # a device this machine does not have is refused before any folder is made or case is built
        from deepinfer.engine.loader import resolve_device

        resolve_device(device)
    if dump:
        dump = check_output_dir(dump, "--dump")
    note = _prepare_interpreter(backend, bool(compare)) or (_prepare_interpreter(against, False) if against else None)
    from deepinfer.debug.ab import compare_dir, run_ab

    err = Console(stderr=True)
    if note and not as_json:
        err.print(note, highlight=False)

    def progress(cr):
        if not as_json and err.is_terminal:
            err.print(f"  {cr.op} {cr.shapes}/{cr.phase}/{cr.variant} …", highlight=False, end="\r")

    if compare:
        rep = compare_dir(compare, backend, ops_regex, do_bench, device, progress)
    else:
        rep = run_ab(backend, ref, ops_regex, shapes, seed, dump, do_bench, device, progress, against)
    vendor = _vendor_note(rep)
    untimed = ("--bench: nothing was timed: timings need a CUDA device, and this run is on "
               f"{rep.device}" if do_bench and not str(rep.device).startswith("cuda") else None)
    note = "\n".join(n for n in (note, vendor, untimed) if n) or None
    if as_json:
        d = rep.to_dict()
        d["note"] = note
        print(json.dumps(d, default=str))
    else:
        _print_table(rep, note, do_bench)
    if not rep.ok:
        raise typer.Exit(1)


def _vendor_note(rep) -> str | None:
    """Which GEMM the Triton backend's fp8_gemm cases ran at prefill sizes, when it was not the Triton kernel."""
    if rep.backend != "triton" or not any(r.op == "fp8_gemm" and r.status != "skip" for r in rep.results):
        return None
    import torch

    from deepinfer.ops.registry import backend_facts

    f = backend_facts(rep.backend, torch.device(rep.device))
    if f.get("fp8_prefill_gemm") != "cublaslt":
        return None
    return (f"fp8_gemm cases of >= {f['fp8_prefill_min_m']} rows ran cuBLASLt's block-scaled FP8 GEMM "
            "(DEEPINFER_FP8_GEMM=triton runs them on the Triton kernel)")


def _print_table(rep, note, do_bench: bool) -> None:
    con = console()
    src = f"saved cases in {rep.source}" if rep.source else f"ref {rep.ref}"
    title = f"A/B · {rep.backend}" + (f" and {rep.against}" if rep.against else "") + f" vs {src} · device {rep.device}" + (" (Triton interpreter)" if rep.interpreter else "")
    if rep.seed is not None:
        title += f" · seed {rep.seed}"
    t = Table(title=title, show_lines=False)
    cols = ["case", "inputs", "dtype", "rel err", "max abs", "bit=", "tol", "result"]
    if do_bench:
        cols += ["time", "GB/s", "TFLOP/s", "of roofline"]
    if rep.against:
        cols += [f"{rep.against} rel err", f"{rep.against}"]
        if do_bench:
            cols += [f"{rep.against} time", f"{rep.against}/{rep.backend} time"]
    right = {"rel err", "max abs", "time", "GB/s", "TFLOP/s", "of roofline"}
    if rep.against:
        right |= {f"{rep.against} rel err", f"{rep.against} time", f"{rep.against}/{rep.backend} time"}
    for c in cols:
        t.add_column(c, justify="right" if c in right else "left",
                     overflow="fold" if c in ("case", "inputs") else "ellipsis")
    style = {"pass": "green", "fail": "bold red", "error": "bold red", "skip": "yellow"}
    grouped: dict[str, list] = {}  # whole shape sets skipped for one reason: one line each below the table
    problems = []
    for r in rep.results:
        if r.status == "skip" and r.variant == "*":
            grouped.setdefault(r.reason, []).append(r)
            continue
        w = r.worst()
        tol = w.get("tol")
        reason = r.reason or ("" if r.status == "pass" else "; ".join(m["detail"] for m in r.outputs if not m["ok"]))
        if r.status != "pass" and reason:
            problems.append((r, reason))
        row = [f"{r.op} {r.shapes}/{r.phase}/{r.variant}" + (" \\[bf16→fp16]" if r.ran_as else ""), r.summary,
               w.get("dtype") or "-", _fmt(w.get("rel_err")),
               _fmt(w.get("max_abs")), "-" if not r.outputs else ("yes" if all(m["bitwise"] for m in r.outputs) else "no"),
               "-" if tol is None else f"{tol[0]:g}/{tol[1]:g}", f"[{style.get(r.status, '')}]{r.status.upper()}[/]"]
        if do_bench:
            row += ["-" if r.time_ms is None else f"{r.time_ms * 1e3:.1f} µs", _fmt(r.gbps, ".1f"),
                    _fmt(r.tflops, ".1f"), "-" if r.of_roofline is None else f"{r.of_roofline:.0%}"]
        if rep.against:
            pr = r.peer
            pw = pr.worst() if pr is not None else {}
            row += [_fmt(pw.get("rel_err")),
                    "-" if pr is None else f"[{style.get(pr.status, '')}]{pr.status.upper()}[/]"]
            if pr is not None and pr.status != "pass" and (pr.reason or pr.outputs):
                problems.append((pr, f"{rep.against}: " + (pr.reason or "; ".join(m["detail"] for m in pr.outputs
                                                                                   if not m["ok"]))))
            if do_bench:
                row += ["-" if pr is None or pr.time_ms is None else f"{pr.time_ms * 1e3:.1f} µs",
                        _fmt(r.peer_time_ratio, ".2f")]
        t.add_row(*row)
    con.print(t)
    for r, reason in problems:
        con.print(f"[{style.get(r.status, '')}]{r.status.upper()}[/] {r.case_id}: {_esc(reason)}", highlight=False)
    for reason, rows in grouped.items():
        ops_n = len({r.op for r in rows})
        sets = ", ".join(dict.fromkeys(r.shapes for r in rows))
        con.print(f"[yellow]SKIP[/] {len(rows)} case(s) ({sets} shapes, {ops_n} op(s)): {_esc(reason)}", highlight=False)
    if rep.not_implemented:
        con.print(f"not implemented in {rep.backend} (not tested): {', '.join(rep.not_implemented)}", highlight=False)
    if note:
        con.print(note, highlight=False)
    if rep.dtype_note():
        con.print(f"[yellow]note:[/yellow] {_esc(rep.dtype_note())}", highlight=False)
    if rep.dumped:
        con.print(f"cases written to {rep.dumped}/ (replay elsewhere: deepinfer ab --backend BACKEND --compare "
                  f"{rep.dumped})", highlight=False)
    p, f, s = rep.counts()
    con.print(f"[{'green' if f == 0 else 'bold red'}]{rep.summary_line()}[/]")


def _esc(s: str) -> str:
    return s.replace("[", "\\[")


def register(app: typer.Typer) -> None:
    app.command("ab")(ab_cmd)
