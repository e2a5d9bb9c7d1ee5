"""One line per phase for the tables gpu_suite.sh and deepgemm.sh print last, from the JSON the commands wrote.

    python tools/device/summarize.py bench BENCH.json              # eager prefill vs its CUDA graph, decode rows
    python tools/device/summarize.py against BENCH.json MAIN PEER  # the main rows vs the first --against rows
    python tools/device/summarize.py tune TUNE.json BENCH.json     # the tuned map, then `against` (tuned vs triton)
    python tools/device/summarize.py entries BENCH.json            # every configuration of a run, with its drift
    python tools/device/summarize.py margin A.json [B.json ...]    # each margin's verdict and logits error
    python tools/device/summarize.py targets BENCH.json            # issue 49's targets, met or missed by how much
    python tools/device/summarize.py fusions DRIFT.json RUN.json...  # each fusion: decode with it off against all on
    python tools/device/summarize.py sweeps FP4.json FP8.json      # the FP4 decode and FP8 exact sweeps' verdicts

A file that is missing or holds no report gives "no report (why)" in its place: the table always gets its row.
"""

import json
import math
import sys

NAN = float("nan")


CUT_OFF: list[str] = []
"""The "cut_off" of each report read for the current summary (a bench stopped by `timeout`: what finished)."""


def last(path: str) -> dict:
    """The last line of a command's --json output, parsed; {"error": why} when there is none."""
    try:
        r = json.loads(open(path).read().strip().splitlines()[-1])
    except Exception as e:  # noqa: BLE001 - a missing or cut-off report is a row, not a crash
        return {"error": str(e)}
    if isinstance(r, dict) and r.get("cut_off"):
        CUT_OFF.append(r["cut_off"])
    return r


def against(b: dict, main: str, peer: str) -> str:
    if "prefill" not in b:
        return f"no report ({b.get('error')})"
    a = (b.get("against") or [{}])[0]
    return (f"TTFT {main} {b['prefill']['ttft_ms']:.1f} ms vs {peer} {a.get('prefill', {}).get('ttft_ms', NAN):.1f}; "
            + " ".join(f"B={d['batch']} {d['ms_per_step']:.3f} vs {x['ms_per_step']:.3f}"
                       for d, x in zip(b["decode"], a.get("decode", []))))


def bench(r: dict) -> str:
    if "prefill" not in r:
        return f"no report ({r.get('error')})"
    pf, pg = r["prefill"], r.get("prefill_graphs") or {}
    d = " ".join(f"B={x['batch']} {x['ms_per_step']:.3f} ms ({x['ratio']:.2f}x)" for x in r["decode"])
    graph = (f"graph skipped ({pg['skipped']})" if "skipped" in pg else
             f"graph {num(pg.get('ttft_ms')):.1f} ms ({num(pg.get('ratio')):.2f}x; host "
             f"{num(pg.get('host_issue_ms')):.2f}, mode {pg.get('mode')}, error {pg.get('graph_error')})")
    pl, do = r.get("prefill_launches") or {}, r.get("decode_ops") or {}
    parts = ([f"prefill {pl['ops']} ops + {pl['torch_ops']} torch"] if pl else []) + (
        [f"decode B={do['batch']} {do['ops_per_step']} ops + {do.get('torch_ops_per_step', '?')} torch"] if do else [])
    launches = f"; launches: {', '.join(parts)}" if parts else ""
    return (f"TTFT eager {pf['ttft_ms']:.1f} ms ({pf['ratio']:.2f}x floor {pf['floor']['floor_ms']:.2f}; host "
            f"{num(pf.get('host_issue_ms')):.1f}, device {num(pf.get('device_ms')):.1f}); {graph}; decode {d}"
            f"{launches}{prefill_ops(r)}")


def prefill_ops(r: dict, top: int = 8) -> str:
    """`bench --profile`'s prefill breakdown in one clause: the `top` ops by device time, then the rest and the
    time between ops; "" without a profile."""
    p = r.get("prefill_ops")
    if not p:
        return ""
    rows = p["ops"][:top]
    rest = sum(x["ms"] for x in p["ops"][top:])
    def how(x):  # a compute op's share of its ceiling, any other op's time over one pass of its bytes
        if x.get("compute", True) and x.get("of_ceiling"):
            return f" ({x['of_ceiling']:.0%} {x['ceiling']})"
        return f" ({x['x_bytes']:.1f}x bytes)" if x.get("x_bytes") else ""

    parts = [f"{x['op']} {x['ms']:.2f}{how(x)}" for x in rows]
    gaps = " (host caught up: includes launch gaps)" if p.get("host_caught_up") else ""
    return (f"; prefill profile {p['total_ms']:.1f} ms{gaps}: " + ", ".join(parts)
            + f", {len(p['ops']) - len(rows)} other ops {rest:.2f}, between ops {p.get('outside_ops_ms', NAN):.2f}")


def entries(b: dict) -> str:
    """Every configuration of one bench run (the main one, then each --against): TTFT eager and as a graph with
    their ratios to the shared floor, decode ms/step, and each entry's drift from the main one."""
    if "prefill" not in b:
        return f"no report ({b.get('error')})"
    out = []
    for name, r in [(b.get("backend"), b)] + [(a["spec"], a) for a in b.get("against", [])]:
        pf, pg, d = r["prefill"], r.get("prefill_graphs") or {}, r.get("drift")
        dec = " ".join(f"B={x['batch']} {x['ms_per_step']:.3f}" for x in r["decode"])
        dr = (f"; drift rel {d['rel_err']:.2e}, top-1 {d['top1_agree']:.0%}, flips {d['flips']} "
              f"(main margin <= {d['max_flip_margin']})") if d else ""
        dd = r.get("decode_drift")
        dr += f", decode steps rel {dd['rel_err']:.2e}, top-1 {dd['top1_agree']:.0%}" if dd else ""
        rq = r.get("requant")
        rq = (f"; experts {r['experts']}: {rq['lossy_stacks']} of {rq['stacks']} stacks lossy, "
              f"span 2^{rq['max_span_log2']}" if rq else "")
        graph = ("graph skipped" if "skipped" in pg else
                 f"graph {num(pg.get('ttft_ms')):.1f} ({num(pg.get('ratio')):.2f}x, {pg.get('mode')})")
        out.append(f"{name}: TTFT {pf['ttft_ms']:.1f} ms ({pf['ratio']:.2f}x), {graph}; {dec}{dr}{rq}")
    return " || ".join(out)


TARGETS = {"ttft_official": 2.0, "ttft_fast": 1.6, "host_share": 0.10, "decode_b1": 1.6, "decode": 1.7}
"""Issue 49's targets, as multiples of the floors the same run measured (host share: of the TTFT)."""


def _verdict(what: str, got: float, target: float) -> str:
    if got != got:  # nan: not measured
        return f"{what}: not measured (target {target:g})"
    return f"{what} {got:.2f} " + ("(met, target " + f"{target:g})" if got <= target else
                                  f"(target {target:g}: missed by {got - target:.2f})")


def _best_ttft(r: dict) -> tuple[float, str]:
    """The smaller TTFT ratio of a configuration's eager prefill and its graph, with which."""
    pf, pg = r["prefill"], r.get("prefill_graphs") or {}
    cands = [(pf["ratio"], "eager")]
    if isinstance(pg.get("ratio"), (int, float)) and pg["ratio"] == pg["ratio"]:
        cands.append((pg["ratio"], "graph"))
    return min(cands)


def targets(b: dict) -> str:
    """Issue 49's targets against one bench run: the main configuration's TTFT (official numerics) and decode
    rows, the best `policy=fast` entry's TTFT, the prefill's host share. Every figure is a multiple of the floor
    measured in that run; a target with no row is "not measured"."""
    if "prefill" not in b:
        return f"no report ({b.get('error')})"
    out = []
    t, how = _best_ttft(b)
    out.append(_verdict(f"TTFT {b.get('numerics')} ({how})", t, TARGETS["ttft_official"]))
    fast = [a for a in b.get("against", []) if (a.get("settings_in_effect") or a.get("settings") or {})
            .get("DEEPINFER_POLICY") == "fast"]
    if fast:
        (t, how), spec = min((_best_ttft(a), a["spec"]) for a in fast)
        out.append(_verdict(f"TTFT fast ({spec}, {how})", t, TARGETS["ttft_fast"]))
    else:
        out.append(_verdict("TTFT fast", NAN, TARGETS["ttft_fast"]))
    pg = b.get("prefill_graphs") or {}
    src = pg if pg.get("host_issue_ms") is not None else b["prefill"]
    share = src["host_issue_ms"] / src["ttft_ms"] if src.get("ttft_ms") else NAN
    out.append(f"host issue {share:.1%} of TTFT " + ("(met" if share <= TARGETS["host_share"] else "(missed")
               + f", target {TARGETS['host_share']:.0%})")
    for d in b["decode"]:
        if d["batch"] <= 64:
            out.append(_verdict(f"decode B={d['batch']}", d["ratio"],
                                TARGETS["decode_b1"] if d["batch"] == 1 else TARGETS["decode"]))
    return "; ".join(out)


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else NAN


def sweeps(fp4: dict, fp8: dict) -> str:
    """The two device sweeps' verdicts. FP4 decode (fp4_decode_sweep.py): per shape and batch, the fastest variant
    and its time against the shipped form's. FP8 exact (fp8_exact_sweep.py): per form, the geometric mean over the
    shapes of exact's time over its own (> 1: faster than exact), its worst share of bf16 outputs off exact's and
    its worst error against the fp32 reference; the exact-wgmma tiling with the best mean is named. A form that
    did not run or came out NaN says so."""
    out = []
    rows4 = [r for r in fp4.get("rows", []) if r.get("us")]
    if rows4:
        for key in dict.fromkeys((r["shape"], r["batch"]) for r in rows4):
            rs = [r for r in rows4 if (r["shape"], r["batch"]) == key]
            ship = next((r for r in rs if r["variant"] == "shipped"), None)
            best = min(rs, key=lambda r: r["us"])
            vs = f" ({best['us'] / ship['us']:.2f}x shipped {ship['us']:.1f} us)" if ship and best is not ship else ""
            out.append(f"fp4 {key[0]} B={key[1]}: {best['variant']} {best['us']:.1f} us{vs}")
    else:
        out.append(f"fp4 decode sweep: no timed rows ({fp4.get('error', 'smoke or empty')})")
    rows8 = [r for r in fp8.get("rows", []) if "error" not in r]
    exact = {r["shape"]: r["ms"] for r in rows8 if r["mode"] == "exact" and r.get("ms")}
    forms: dict[str, list[dict]] = {}
    for r in rows8:
        if r["mode"] != "exact" and r.get("ms") and r["shape"] in exact:
            forms.setdefault(r["variant"], []).append(r)
    if not forms:
        out.append(f"fp8 exact sweep: no timed rows ({fp8.get('error', 'smoke or empty')})")
    speed = {v: _geomean([exact[r["shape"]] / r["ms"] for r in rs]) for v, rs in forms.items()}
    for v, rs in forms.items():
        bad = " NaN" if any(r.get("nan") for r in rs) else ""
        out.append(f"fp8 {v}: {speed[v]:.2f}x exact over {len(rs)} shapes, outputs off exact's <= "
                   f"{max(r.get('differ_from_exact') or 0 for r in rs):.2%}, rel err <= "
                   f"{max(r['rel_err'] for r in rs):.1e}{bad}")
    wg = {v: x for v, x in speed.items() if v.startswith("exact-wgmma")}
    if wg:
        out.append(f"best exact-wgmma tiling: {max(wg, key=wg.get)}")
    skipped = sorted({r["variant"] for r in fp8.get("rows", []) if "error" in r})
    if skipped:
        out.append("fp8 not run: " + ", ".join(skipped))
    return "; ".join(out)


def fusions(drift_run: dict, runs: list[dict]) -> str:
    """Decode ms/step of fresh-process bench runs, one configuration each (`DEEPINFER_DECODE_FUSIONS` = on, off or
    -OP, as the run's settings say), each against the mean of the `on` runs -- how much slower a configuration is,
    i.e. what the fusions it turns off gain (negative: they cost) -- with the spread of the `on` runs, and each
    configuration's decode-step drift from the `on` logits, from `drift_run` (one process, every configuration
    as an `--against` entry: 0 where the fusions it turns off give their two ops' bits). Timings come from fresh
    processes because in one process the first configuration timed ran 5-8 % faster than the later ones
    (docs/perf-log.md, 2026-11-30, call 76)."""
    key = "DEEPINFER_DECODE_FUSIONS"
    runs = [r for r in runs if "decode" in r]
    if not runs:
        return "no report (no run has decode rows)"
    on = [r for r in runs if (r.get("settings") or {}).get(key) == "on"]
    if not on:
        return "no report (no run with every fusion on)"
    batches = [d["batch"] for d in on[0]["decode"]]
    base = {B: sum(d["ms_per_step"] for r in on for d in r["decode"] if d["batch"] == B) / len(on) for B in batches}
    spread = {B: (max(ms) - min(ms)) / base[B] * 100 for B in batches
              if (ms := [d["ms_per_step"] for r in on for d in r["decode"] if d["batch"] == B])}
    ops = on[0].get("decode_ops") or {}
    counts = ", ".join(f"{ops[k]:.0f} {what}" for k, what in (("ops_per_step", "ops"), ("torch_ops_per_step", "torch ops"),
                                                                  ("kernels_per_step", "kernels"))
                       if isinstance(ops.get(k), (int, float)))
    drifts = {(a.get("settings") or {}).get(key): a.get("decode_drift") for a in drift_run.get("against", [])}
    out = [f"on ({len(on)} runs): " + " ".join(f"B={B} {base[B]:.3f} (spread {spread[B]:.1f}%)" for B in batches)
           + (f", {counts} per B={ops.get('batch')} step" if counts else "")]
    for r in runs:
        v = (r.get("settings") or {}).get(key)
        if v == "on":
            continue
        dd = drifts.get(v)
        dd = f", decode drift rel {dd['rel_err']:.1e}, top-1 {dd['top1_agree']:.0%}" if dd else ", no drift row"
        out.append(f"{v}: " + " ".join(f"B={d['batch']} {d['ms_per_step']:.3f} "
                                        f"({(d['ms_per_step'] / base[d['batch']] - 1) * 100:+.1f}%)"
                                        for d in r["decode"] if d["batch"] in base) + dd)
    return "; ".join(out)


def tune(t: dict, b: dict) -> str:
    moved = {k: v for k, v in (t.get("ops") or {}).items() if v != "triton"}
    line = f"map: {len(t.get('ops') or {})} ops, off triton: {moved}"
    return line + ("; " + against(b, "tuned", "triton") if "prefill" in b else "")


def margin(paths: list[str]) -> str:
    out = []
    for p in paths:
        r = last(p)
        out.append(f"{p}: no report ({r['error']})" if "error" in r else
                   f"{p.split('_')[-1][:-5]}: {r.get('verdict')} agree {r.get('agreement')} "
                   f"max logit err {r.get('max_logits_rel_err')}")
    return "; ".join(out)


def num(x) -> float:
    """A report's number for formatting: NaN where the field is absent or null (a CPU run has no device time)."""
    return NAN if x is None else x


def main(argv: list[str]) -> str:
    kind, args = argv[0], argv[1:]
    if kind not in KINDS:
        raise SystemExit(f"summarize.py: unknown kind {kind!r} ({' | '.join(KINDS)})")
    CUT_OFF.clear()
    try:
        line = _summary(kind, args)
    except Exception as e:  # noqa: BLE001 - a report this script did not foresee is a row, not a lost table
        line = f"no report (summarize.py {kind} failed: {type(e).__name__}: {e})"
    return line + (f" [cut off: {'; '.join(CUT_OFF)}]" if CUT_OFF else "")


KINDS = ("bench", "against", "entries", "tune", "margin", "targets", "fusions", "sweeps")


def _summary(kind: str, args: list[str]) -> str:
    if kind == "bench":
        return bench(last(args[0]))
    if kind == "entries":
        return entries(last(args[0]))
    if kind == "against":
        return against(last(args[0]), args[1], args[2])
    if kind == "tune":
        return tune(last(args[0]), last(args[1]))
    if kind == "margin":
        return margin(args)
    if kind == "targets":
        return targets(last(args[0]))
    if kind == "sweeps":
        return sweeps(_whole(args[0]), _whole(args[1]))
    return fusions(last(args[0]), [last(a) for a in args[1:]])


def _whole(path: str) -> dict:
    """A JSON document (the sweeps write one, indented); {"error": why} when there is none."""
    try:
        return json.loads(open(path).read())
    except Exception as e:  # noqa: BLE001 - a missing or cut-off report is a row, not a crash
        return {"error": str(e)}


if __name__ == "__main__":
    print(main(sys.argv[1:]))
