"""`deepinfer bench`: prefill / decode speed of the engine against floors from measured bandwidth and FLOPs."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import shlex
import signal
import sys

import typer
from rich.console import Console
from rich.table import Table

from deepinfer.bench.run import BenchCutOff, BenchOptions, run_bench
from deepinfer.engine.loader import OptionError
from deepinfer.outpath import atomic_write, check_output
from deepinfer_cli import common
from deepinfer_cli.console import console
from deepinfer_cli.errors import handle_errors

GiB = 2**30

DOC_HEADER = """# Performance

Rows are appended by `deepinfer bench ... --record docs/perf-log.md`; every number in a row was
measured in that one run on the named device (nothing is copied from specs).

## How to read this table

* **date, device, torch / triton**: when and where the row was measured.
* **backend · numerics**: the kernel backend (`torch` reference, `triton`, `tilelang`) and the numerics mode
  (`official` = FP8/FP4 weights as stored, `exact` = dequantised). Decode runs as captured CUDA graphs on CUDA with a kernel backend (eager with `--eager` or the torch backend).
* **model**: the preset (random weights in the release formats, e.g. `v4-flash-slice4` = 4 Flash layers
  with every attention kind + MTP) or the checkpoint name.
* **TTFT ms (P)**: time to first token for one P-token prompt = one prefill (warm median of 3).
* **prefill tok/s**: P / TTFT.
* **decode ms/step (x floor)**: per batch size B, one decode step of B rows together; in brackets the
  ratio to the floor (1.0x = at the floor). Floor = max(bytes / measured copy bandwidth, FLOPs / measured
  bf16 matmul rate); bytes = every main layer's attention + shared expert + norms, the expected distinct
  routed experts E(1-(1-k/E)^B) per layer, the LM head (as bf16, the checkpoint format), the KV entries
  read. The JSON output (`--json`) also has the floor with the bytes the engine actually holds.
* **tok/s @B**: decode tokens per second at the largest batch.
* **peak GiB**: peak allocated device memory (weights + caches + activations).
* **vs transformers**: transformers' DeepseekV4ForCausalLM (bf16, eager) decode step time / ours, at
  batch 1 and the largest batch (>1 = DeepInfer faster), or why it could not run.

| date | device | torch / triton | backend · numerics | model | command | TTFT ms (P) | prefill tok/s | decode ms/step (x floor) | tok/s @B | peak GiB | vs transformers |
|---|---|---|---|---|---|---|---|---|---|---|---|
"""


def _parse_batches(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise OptionError(f"--batch {text!r}: expected comma-separated integers, e.g. 1,8,32") from None
    if not out or min(out) < 1:
        raise OptionError(f"--batch {text!r}: batch sizes must be >= 1")
    return out


def _peer_cell(report: dict) -> str:
    peer = report.get("peer")
    if not peer:
        return "-"
    if "error" in peer:
        return "failed: " + peer["error"].replace("|", "/")[:80]
    return "; ".join(f"B={r['batch']}: {r['speedup_ours']:.2f}x" for r in peer["decode"] if "speedup_ours" in r)


def record(path: str, report: dict, command: str) -> None:
    """Append one row for `report` to the markdown table in `path` (created with its header if missing), and one
    per `--against` configuration; the file is rewritten through a rename, so an interrupted write never leaves
    half a row."""
    head = "" if os.path.isfile(path) else DOC_HEADER
    pf, dec = report["prefill"], report["decode"]
    last = dec[-1]
    cells = [
        datetime.date.today().isoformat(), report["device_name"],
        f"{report['torch']} / {report['triton'] or '-'}", f"{_backend_cell(report)} · {report['numerics']}",
        report["model"], f"`{command}`", f"{pf['ttft_ms']:.1f} ({pf['prompt_len']})", f"{pf['tokens_per_s']:.0f}",
        _decode_cell(dec), f"{last['tokens_per_s']:.0f} @{last['batch']}",
        f"{report['peak_mem_bytes'] / GiB:.1f}" if report.get("peak_mem_bytes") else "-", _peer_cell(report),
    ]
    rows = [cells]
    for a in report.get("against", []):  # the same run's other configurations, against the same floors
        apf, adec = a["prefill"], a["decode"]
        rows.append(cells[:3] + [f"{a['spec']} · {report['numerics']} (same run as {_backend_cell(report)})",
                                 cells[4], cells[5], f"{apf['ttft_ms']:.1f} ({apf['prompt_len']})",
                                 f"{apf['tokens_per_s']:.0f}", _decode_cell(adec),
                                 f"{adec[-1]['tokens_per_s']:.0f} @{adec[-1]['batch']}", "-", "-"])
    new = ["| " + " | ".join(c.replace("\n", " ") for c in r) + " |" for r in rows]
    if head:
        atomic_write(path, head + "\n".join(new) + "\n")
        return
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    # the new rows go under the table's last dated row (the file may go on with prose below the table)
    last = max((i for i, ln in enumerate(lines) if re.match(r"^\| \d{4}-\d{2}-\d{2} \|", ln)), default=None)
    if last is None:
        lines = lines[:-1] + new + [""] if lines and lines[-1] == "" else lines + new + [""]
    else:
        lines[last + 1:last + 1] = new
    atomic_write(path, "\n".join(lines))


def _decode_cell(decode: list[dict]) -> str:
    """A row's decode cell: ms per step and the ratio to the floor, per batch size."""
    return "; ".join(f"B={d['batch']}: {d['ms_per_step']:.2f} ({d['ratio']:.1f}x)" for d in decode)


def _backend_cell(report: dict) -> str:
    """The backend and, when there is one, the per-op map (`--op`) the run used."""
    return report["backend"] + (f" (--op {report['op_map']})" if report.get("op_map") else "")


def _print(report: dict, con: Console) -> None:
    gb = lambda b: f"{b / GiB:.2f}"  # noqa: E731
    con.print(f"[bold]{report['model']}[/bold] · {report['source']}", highlight=False)
    con.print(f"{report['device_name']} · torch {report['torch']} · triton {report['triton'] or '-'} · backend "
              f"{_backend_cell(report)} · {report['numerics']}/{report['dtype']}", highlight=False)
    con.print(f"measured: copy bandwidth {report['bandwidth_Bps'] / 1e9:.0f} GB/s, {report['matmul_measured']} "
              f"{report['matmul_flops'] / 1e12:.1f} TFLOP/s; weights made in {report['weights_s']:.1f} s; engine "
              f"holds {gb(report['engine_weight_bytes'])} GiB of weights (checkpoint format, main layers: "
              f"{gb(report['checkpoint_bytes_main'])} GiB)", highlight=False)
    con.print(f"[dim]decode: {'CUDA graphs' if report['cuda_graphs'] else 'eager'} "
              f"({', '.join(sorted({d['mode'] for d in report['decode']}))})[/dim]")
    if report.get("profile"):
        t = Table(title="decode step profile (eager): kernels by time")
        for c in ("kernel", "calls/step", "ms/step", "share"):
            t.add_column(c, justify="left" if c == "kernel" else "right")
        for r in report["profile"]:
            t.add_row(r["name"], f"{r['calls_per_step']:.0f}", f"{r['ms_per_step']:.3f}", f"{r['share']:.1%}")
        con.print(t)
    pops = report.get("prefill_ops")
    if pops:
        fp8 = report.get("matmul_fp8_flops")
        host = f", host issue {pops['host_issue_ms']:.1f} ms" if "host_issue_ms" in pops else ""
        t = Table(title=f"prefill 1 x {pops['prompt_len']} ({pops['total_ms']:.1f} ms device{host}): every op by "
                        f"time, compute ops' rate vs measured fp8 {fp8 / 1e12 if fp8 else float('nan'):.0f} / bf16 "
                        f"{report['matmul_flops'] / 1e12:.0f} TFLOP/s")
        for c in ("op", "calls", "ms", "share", "TFLOP/s", "of ceiling", "MB", "x bytes"):
            t.add_column(c, justify="left" if c == "op" else "right")

        def mb(x):  # the bytes its tensors hold, and its time over one pass of them at the copy bandwidth
            xb = x.get("x_bytes")
            return (f"{x['bytes'] / 1e6:.0f}" if "bytes" in x else "-", f"{xb:.1f}x" if xb else "-")

        for r in pops["ops"]:
            compute = r.get("compute", True)
            t.add_row(r["op"], str(r["calls"]), f"{r['ms']:.2f}", f"{r['ms'] / pops['total_ms']:.1%}",
                      f"{r['tflops']:.0f}" if compute else "-",
                      f"{r['of_ceiling']:.0%} {r['ceiling']}" if compute and r["of_ceiling"] else "-", *mb(r))
            for x in r.get("shapes", []) if compute and len(r.get("shapes", [])) > 1 else []:
                t.add_row(f"[dim]  {x['shape']}[/dim]", str(x["calls"]), f"{x['ms']:.2f}",
                          f"{x['ms'] / pops['total_ms']:.1%}", f"{x['tflops']:.0f}",
                          f"{x['of_ceiling']:.0%}" if x["of_ceiling"] else "-", *mb(x))
        if "outside_ops_ms" in pops:
            t.add_row("[dim](between ops: torch glue)[/dim]", "", f"{pops['outside_ops_ms']:.2f}",
                      f"{pops['outside_ops_ms'] / pops['total_ms']:.1%}", "", "", "", "")
        con.print(t)
        if any(r.get("x_bytes") for r in pops["ops"]):
            con.print("[dim]x bytes: an op's time over the time to move the bytes its tensors hold once at the copy "
                      "bandwidth; for an op that reads all of its inputs, at least its times-floor (one that gathers "
                      "from a cache counts the whole cache)[/dim]")
        if pops.get("host_caught_up"):
            con.print(f"[yellow]prefill profile: the host issued the timed pass in {pops['timed_issue_ms']:.1f} ms, "
                      f"past its {pops['head_start_ms']:.1f} ms head start: op times include launch gaps[/yellow]")
    for d in report["decode"]:
        if d.get("graph_error"):
            con.print(f"[red]batch {d['batch']}: graph capture failed, timed eagerly: {d['graph_error']}[/red]")
    pf = report["prefill"]
    con.print(f"prefill 1 x {pf['prompt_len']}: TTFT {pf['ttft_ms']:.1f} ms (cold {pf['cold_ms']:.0f} ms), "
              f"{pf['tokens_per_s']:.0f} tokens/s; floor {pf['floor']['floor_ms']:.2f} ms -> {pf['ratio']:.1f}x; "
              f"{_issue(pf)}", highlight=False)
    pg = report.get("prefill_graphs")
    if pg and "skipped" in pg:
        con.print(f"prefill as a CUDA graph: skipped ({pg['skipped']})", highlight=False)
    elif pg:
        con.print(f"prefill as a CUDA graph ({pg['mode']}): TTFT {pg['ttft_ms']:.1f} ms ({pg['ratio']:.1f}x floor, "
                  f"{pg['vs_eager']:.2f}x eager); {_issue(pg)}"
                  + (f"; [red]capture failed: {pg['graph_error']}[/red]" if pg.get("graph_error") else ""),
                  highlight=False)
    t = Table(title=f"decode ({report['gen_len']} steps after a {report['prompt_len']}-token prompt per row)")
    for col in ("batch", "ms/step", "tokens/s", "floor bytes ms", "engine-bytes ms", "FLOP ms", "x floor",
                "x engine floor", "experts/layer", "peak GiB"):
        t.add_column(col, justify="right")
    for d in report["decode"]:
        f = d["floor"]
        t.add_row(str(d["batch"]), f"{d['ms_per_step']:.2f}", f"{d['tokens_per_s']:.1f}", f"{f['t_bytes_ckpt_ms']:.3f}",
                  f"{f['t_bytes_engine_ms']:.3f}", f"{f['t_flops_ms']:.3f}", f"{d['ratio']:.1f}",
                  f"{d['ratio_engine_bytes']:.1f}", f"{f['distinct_experts_per_layer']:.1f}",
                  gb(d["peak_mem_bytes"]) if "peak_mem_bytes" in d else "-")
    con.print(t)
    do = report.get("decode_ops")
    if do:
        top = ", ".join(f"{k} {v}" for k, v in list(do["by_op"].items())[:6])
        kern = f", {do['kernels_per_step']:.0f} CUDA kernels (--profile)" if "kernels_per_step" in do else ""
        glue = ""
        if "torch_ops_per_step" in do:
            sites = ", ".join(f"{k} {v}" for k, v in list(do["torch_ops"].items())[:4])
            glue = f" + {do['torch_ops_per_step']} torch ops between them" + (f" ({sites})" if sites else "")
        con.print(f"decode step at batch {do['batch']}: {do['ops_per_step']} registry ops{glue}{kern}; most called: "
                  f"{top}", highlight=False)
    pl = report.get("prefill_launches")
    if pl:
        sites = ", ".join(f"{k} {v}" for k, v in list(pl["torch_by_site"].items())[:4])
        con.print(f"prefill of {pl['tokens']} tokens: {pl['ops']} registry ops + {pl['torch_ops']} torch ops between "
                  f"them" + (f" ({sites})" if sites else ""), highlight=False)
    if report.get("fp8_prefill_gemm"):
        con.print(f"prefill FP8 GEMMs (M >= 65): {report['fp8_prefill_gemm']}", highlight=False)
    if report.get("fallbacks"):
        con.print(f"ops on the torch reference (no kernel in their backend): {', '.join(report['fallbacks'])}",
                  highlight=False)
    if report.get("against"):
        _print_against(report, con)
    if report.get("guided"):
        t = Table(title="guided decoding: decode + sample (temperature 1) + logprobs per step; the mask filled on "
                        "the host while the step runs")
        for col in ("batch", "no mask ms", "all-ones ms", "overhead", "JSON matcher ms", "overhead",
                    "host fill ms", "host accept ms"):
            t.add_column(col, justify="right")
        for g in report["guided"]:
            t.add_row(str(g["batch"]), f"{g['off_ms']:.3f}", f"{g['all_ones_ms']:.3f}",
                      f"{g['all_ones_overhead_ms']:+.3f}", f"{g['json_ms']:.3f}", f"{g['json_overhead_ms']:+.3f}",
                      f"{g['json_fill_ms']:.3f}", f"{g['json_accept_ms']:.3f}")
        con.print(t)
    if report.get("speculative"):
        _print_speculative(report, con)
    peer = report.get("peer")
    if peer:
        p = Table(title=f"peer: {peer['name']}")
        for col in ("batch", "transformers ms/step", "DeepInfer ms/step", "DeepInfer speed-up"):
            p.add_column(col, justify="right")
        if "error" in peer:
            p.add_row("-", "failed", "-", peer["error"])
        else:
            ours = {d["batch"]: d["ms_per_step"] for d in report["decode"]}
            for r in peer["decode"]:
                p.add_row(str(r["batch"]), f"{r['ms_per_step']:.2f}", f"{ours[r['batch']]:.2f}",
                          f"{r['speedup_ours']:.2f}x")
        con.print(p)


def drift_cell(d: dict | None) -> str:
    """`deepinfer.bench.drift`'s record in one cell: relative error, top-1 agreement, the largest flipped margin."""
    if not d:
        return "-"
    margin = f" (main margin <= {d['max_flip_margin']:.3g})" if d.get("max_flip_margin") is not None else ""
    flips = f", {d['flips']} flips{margin}" if d["flips"] else ""
    return f"rel {d['rel_err']:.2e}, top-1 {d['top1_agree']:.0%} of {d['positions']}{flips}"


def _print_against(report: dict, con: Console) -> None:
    """The main configuration and each `--against` one side by side: TTFT and decode ms/step, each with its
    ratio to the (shared) floor, and the peers' ratio to the main row."""
    main, pf = _backend_cell(report), report["prefill"]
    t = Table(title=f"same run, same floors: {report['prompt_len']}-token prefill and decode ms/step (x floor; "
                    f"peers also / {main})")
    t.add_column("configuration", justify="left")
    t.add_column(f"TTFT ms (P {report['prompt_len']})", justify="right")
    for d in report["decode"]:
        t.add_column(f"decode B={d['batch']}", justify="right")
    t.add_column("drift from main: prompt's last logits", justify="left")
    t.add_column("decode steps' logits", justify="left")
    t.add_row(main, f"{pf['ttft_ms']:.2f} ({pf['ratio']:.1f}x)",
              *[f"{d['ms_per_step']:.3f} ({d['ratio']:.1f}x)" for d in report["decode"]], "-", "-")
    for a in report["against"]:
        pf = a["prefill"]
        t.add_row(a["spec"], f"{pf['ttft_ms']:.2f} ({pf['ratio']:.1f}x; {pf['vs_main']:.2f})",
                  *[f"{d['ms_per_step']:.3f} ({d['ratio']:.1f}x; {d['vs_main']:.2f})" for d in a["decode"]],
                  drift_cell(a.get("drift")), drift_cell(a.get("decode_drift")))
    con.print(t)
    for a in report["against"]:
        rq = a.get("requant")
        if rq:  # experts=fp8: what the requantisation changed (`deepinfer.engine.expert_form`)
            con.print(f"{a['spec']}: routed experts requantised to per-128 FP8: {rq['stacks']} stacks, "
                      f"{rq['lossy_stacks']} lossy (largest rel err {rq['max_rel_err']:.2e}), group scales within "
                      f"2^{rq['max_span_log2']} of their block's largest", highlight=False)
        if a.get("fallbacks"):
            con.print(f"{a['spec']}: ops on the torch reference: {', '.join(a['fallbacks'])}", highlight=False)
        for d in a["decode"]:
            if d.get("graph_error"):
                con.print(f"[red]{a['spec']} batch {d['batch']}: graph capture failed, timed eagerly: "
                          f"{d['graph_error']}[/red]")


def _print_speculative(report: dict, con: Console) -> None:
    """The speculative step against plain decode, the measured acceptance, and the labelled projection."""
    spec = report["speculative"]
    k = spec[0]["k"]
    t = Table(title=f"speculative decoding, K = {k} MTP drafts per step (measured)")
    for col in ("batch", "step ms", "plain decode ms", "step / plain", "acceptance", "tokens/step", "tokens/s",
                "plain tokens/s"):
        t.add_column(col, justify="right")
    for d in spec:
        t.add_row(str(d["batch"]), f"{d['ms_per_step']:.2f}", f"{d['plain_ms_per_step']:.2f}",
                  f"{d['step_vs_plain']:.2f}",
                  f"{d['acceptance_measured']:.3f}", f"{d['tokens_per_step_measured']:.2f}",
                  f"{d['tokens_per_s_measured']:.1f}", f"{d['plain_tokens_per_s']:.1f}")
    con.print(t)
    p = Table(title="PROJECTION from the measured step costs: tokens/s if each draft were accepted with "
                    "probability a (not measured)")
    p.add_column("batch", justify="right")
    for a in spec[0]["projected"]:
        p.add_column(f"a = {a['acceptance']}: tok/s (x plain)", justify="right")
    for d in spec:
        p.add_row(str(d["batch"]), *[f"{x['tokens_per_s']:.1f} ({x['vs_plain']:.2f}x)" for x in d["projected"]])
    con.print(p)
    for note in report.get("notes", []):
        con.print(f"[yellow]{note}[/yellow]", highlight=False)
    for d in spec:
        if d.get("graph_error"):
            con.print(f"[red]batch {d['batch']}: speculative graph capture failed, timed eagerly: "
                      f"{d['graph_error']}[/red]")


@handle_errors
def bench_cmd(
    model: str = typer.Option(None, "--model", "-m", help="Checkpoint directory (default: --preset)."),
    preset: str = typer.Option(None, "--preset", help="Random weights in the release formats: tiny | "
                               "flash-slice:N | pro-slice:N | flash | pro (default tiny when no --model)."),
    batch: str = typer.Option("1,8,32,64", "--batch", help="Decode batch sizes, comma-separated."),
    prompt_len: int = typer.Option(128, "--prompt-len", help="Prompt tokens per row (prefill / TTFT length)."),
    gen_len: int = typer.Option(32, "--gen-len", help="Timed decode steps per batch size."),
    backend: str = common.BACKEND,
    strict: bool = common.STRICT,
    op_map: str = common.OPS,
    numerics: str = common.NUMERICS,
    dtype: str = common.DTYPE,
    device: str = common.DEVICE,
    eager: bool = typer.Option(False, "--eager", help="Time decode eagerly instead of as captured CUDA graphs."),
    prefill_graphs: bool = typer.Option(False, "--prefill-graphs", help="Also time the prefill replayed as a CUDA "
                                        "graph (host issue off the critical path), beside the eager one."),
    profile: bool = typer.Option(False, "--profile", help="Also profile one eager decode step at the first batch "
                                 "size and list the kernels by time."),
    peer: str = typer.Option(None, "--peer", help="Also time `transformers` (DeepseekV4ForCausalLM, bf16) "
                             "on the same weights."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random weights and prompt tokens."),
    guided: bool = typer.Option(False, "--guided", help="Also time guided decoding's per-step overhead at each "
                                "batch size: decode + sample without a mask, with all-ones masks, and with an "
                                "xgrammar JSON matcher per row (needs the guided extra)."),
    against: list[str] = typer.Option(None, "--against", help="Also time another configuration in the same run, "
                                      "against the same floors (repeatable): a backend (triton), or a backend "
                                      "with a per-op map (triton:grouped_gemm=tilelang,sparse_attn_fp8=tilelang), "
                                      "with settings read per call among the entries (triton:policy=fast, "
                                      "triton:grouped_gemm=tilelang,DEEPINFER_TL_FP4=fold), or with the routed "
                                      "experts requantised to per-128 FP8 for the entry (triton:experts=fp8); each "
                                      "reports its drift from the main configuration's logits."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    record_to: str = typer.Option(None, "--record", help="Append a row to this markdown file "
                                  "(e.g. docs/perf-log.md)."),
    speculate: int = typer.Option(0, "--speculate", help="Also time MTP speculative steps of K drafts per batch "
                                  "size: step cost against plain decode, measured acceptance, and tokens/s "
                                  "projected at acceptance 0.5 / 0.7 / 0.9."),
):
    """Measure TTFT, prefill and decode speed, and compare with floors from measured bandwidth and FLOPs.

    Example: deepinfer bench --preset flash-slice:4 --batch 1,8,32 --device cuda --json
    """
    if model and preset:
        raise OptionError("--model and --preset are exclusive")
    if record_to:
        record_to = check_output(record_to, "--record", inputs=(model,))
        _check_record_file(record_to)
    opts = BenchOptions(preset=None if model else (preset or "tiny"), model=model, batches=_parse_batches(batch),
                        prompt_len=prompt_len, gen_len=gen_len, backend=backend, strict=strict, op_map=op_map,
                        numerics=numerics,
                        dtype=dtype, device=device, seed=seed, peer=peer, eager=eager, progress=not as_json,
                        profile=profile, guided=guided, speculate=speculate, against=tuple(against or ()),
                        prefill_graphs=prefill_graphs)
    err = Console(stderr=True)
    with _cut_off_on_sigterm():
        report = run_bench(opts, log=(lambda m: None) if as_json else (lambda m: err.print(f"[dim]{m}[/dim]")))
    if report.get("cut_off"):  # what finished, as JSON either way (the tables expect every section)
        print(json.dumps(report, default=str))
        print(f"deepinfer bench: stopped by SIGTERM; the JSON above holds what finished ({report['cut_off']})"
              + (f"; no row recorded in {record_to}" if record_to else ""), file=sys.stderr)
        raise typer.Exit(128 + signal.SIGTERM)  # a cut-off run is no row for the perf log
    if as_json:  # the results first: a failure to record the row loses nothing
        print(json.dumps(report, default=str))
    else:
        _print(report, console())
    if record_to:
        argv = ["deepinfer", "bench"] + (["--model", model] if model else ["--preset", opts.preset])
        argv += ["--batch", batch, "--prompt-len", str(prompt_len), "--gen-len", str(gen_len)]
        argv += ["--backend", backend] if backend else []
        argv += ["--op", op_map] if op_map else []
        argv += ["--numerics", numerics] if numerics != "official" else []
        argv += (["--device", device] if device else []) + (["--peer", peer] if peer else [])
        argv += ["--prefill-graphs"] if prefill_graphs else []
        for a in against or ():
            argv += ["--against", a]
        record(record_to, report, shlex.join(argv))
        print(f"recorded a row in {record_to}", file=sys.stderr)


def _check_record_file(path: str) -> None:
    """An existing --record file must be text this command can append a row to: checked before the run."""
    if not os.path.isfile(path):
        return
    try:
        with open(path, encoding="utf-8") as f:
            f.read()
    except UnicodeDecodeError as e:
        raise OptionError(f"--record {path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                          "give a markdown file") from None
    except OSError as e:
        raise OptionError(f"--record {path}: cannot read it ({e.strerror})") from None


@contextlib.contextmanager
def _cut_off_on_sigterm():
    """While a bench runs, SIGTERM (what `timeout` sends at its limit) stops the measurements and the report so far
    is printed, instead of the process dying with nothing written; the handler is restored afterwards."""
    def stop(signum, frame):
        raise BenchCutOff("SIGTERM")

    try:
        prev = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread: no handler can be set, the default stays
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, prev)


def _issue(pf: dict) -> str:
    """The host's issue time of a prefill against its device time (the share the host holds the critical path)."""
    if pf.get("device_ms") is None:
        return f"host issue {pf['host_issue_ms']:.1f} ms"
    return f"host issue {pf['host_issue_ms']:.1f} ms of {pf['ttft_ms']:.1f} ({pf['host_issue_ms'] / pf['ttft_ms']:.0%}), " \
           f"device {pf['device_ms']:.1f} ms"


def register(app: typer.Typer) -> None:
    app.command("bench")(bench_cmd)
