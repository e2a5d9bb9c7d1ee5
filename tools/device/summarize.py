"""One line per phase for the tables gpu_suite.sh and deepgemm.sh print last, from the JSON the commands wrote.

    python tools/device/summarize.py bench BENCH.json              # eager prefill vs its CUDA graph, decode rows
    python tools/device/summarize.py against BENCH.json MAIN PEER  # the main rows vs the first --against rows
    python tools/device/summarize.py tune TUNE.json BENCH.json     # the tuned map, then `against` (tuned vs triton)
    python tools/device/summarize.py entries BENCH.json            # every configuration of a run, with its drift
    python tools/device/summarize.py margin A.json [B.json ...]    # each margin's verdict and logits error

A file that is missing or holds no report gives "no report (why)" in its place: the table always gets its row.
"""

import json
import sys

NAN = float("nan")


def last(path: str) -> dict:
    """The last line of a command's --json output, parsed; {"error": why} when there is none."""
    try:
        return json.loads(open(path).read().strip().splitlines()[-1])
    except Exception as e:  # noqa: BLE001 - a missing or cut-off report is a row, not a crash
        return {"error": str(e)}


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
    return (f"TTFT eager {pf['ttft_ms']:.1f} ms ({pf['ratio']:.2f}x floor {pf['floor']['floor_ms']:.2f}; host "
            f"{pf['host_issue_ms']:.1f}, device {pf['device_ms']:.1f}); graph {pg.get('ttft_ms', NAN):.1f} ms "
            f"({pg.get('ratio', NAN):.2f}x; host {pg.get('host_issue_ms', NAN):.2f}, mode {pg.get('mode')}, "
            f"error {pg.get('graph_error')}); decode {d}")


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
        rq = r.get("requant")
        rq = (f"; experts {r['experts']}: {rq['lossy_stacks']} of {rq['stacks']} stacks lossy, span 2^{rq['max_span_log2']}"
              if rq else "")
        out.append(f"{name}: TTFT {pf['ttft_ms']:.1f} ms ({pf['ratio']:.2f}x), graph {pg.get('ttft_ms', NAN):.1f} "
                   f"({pg.get('ratio', NAN):.2f}x, {pg.get('mode')}); {dec}{dr}{rq}")
    return " || ".join(out)


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


def main(argv: list[str]) -> str:
    kind, args = argv[0], argv[1:]
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
    raise SystemExit(f"summarize.py: unknown kind {kind!r} (bench | against | entries | tune | margin)")


if __name__ == "__main__":
    print(main(sys.argv[1:]))
