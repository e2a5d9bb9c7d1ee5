"""The one-line summaries the GPU scripts print last (tools/device/summarize.py): issue 49's targets read from a
bench report, met or missed by how much, and a report that is missing named, not crashed on."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location("summarize", Path(__file__).parent.parent / "tools/device/summarize.py")
summarize = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(summarize)


def _report():
    dec = [{"batch": b, "ms_per_step": r * 0.5, "ratio": r} for b, r in ((1, 1.74), (8, 1.69), (64, 1.71))]
    return {
        "numerics": "official@60d8d707",
        "prefill": {"ttft_ms": 42.7, "ratio": 3.35, "host_issue_ms": 18.2},
        "prefill_graphs": {"ttft_ms": 42.5, "ratio": 3.33, "host_issue_ms": 0.28},
        "decode": dec,
        "against": [
            {"spec": "triton:policy=fast", "settings": {"DEEPINFER_POLICY": "fast"},
             "prefill": {"ttft_ms": 30.0, "ratio": 2.35}, "prefill_graphs": {"ratio": 2.30}, "decode": dec},
            {"spec": "triton:experts=fp8,policy=fast", "settings": {"DEEPINFER_POLICY": "fast"},
             "prefill": {"ttft_ms": 20.0, "ratio": 1.57}, "prefill_graphs": {"ratio": float("nan")}, "decode": dec},
            {"spec": "triton:grouped_gemm=tilelang", "settings": {},
             "prefill": {"ttft_ms": 10.0, "ratio": 0.8}, "decode": dec},
        ],
    }


def test_targets_name_each_one_met_or_missed_by_how_much():
    line = summarize.targets(_report())
    parts = line.split("; ")
    assert parts[0] == "TTFT official@60d8d707 (graph) 3.33 (target 2: missed by 1.33)"
    # the best fast entry, its eager row where its graph did not measure; a non-fast entry is not counted
    assert parts[1] == "TTFT fast (triton:experts=fp8,policy=fast, eager) 1.57 (met, target 1.6)"
    assert parts[2] == "host issue 0.7% of TTFT (met, target 10%)"
    assert parts[3:] == ["decode B=1 1.74 (target 1.6: missed by 0.14)", "decode B=8 1.69 (met, target 1.7)",
                         "decode B=64 1.71 (target 1.7: missed by 0.01)"]


def test_targets_without_a_fast_entry_or_a_report(tmp_path):
    r = _report()
    r["against"] = []
    assert "TTFT fast: not measured (target 1.6)" in summarize.targets(r)
    bad = tmp_path / "bench.json"
    bad.write_text("")
    assert summarize.main(["targets", str(bad)]).startswith("no report (")
    ok = tmp_path / "ok.json"
    ok.write_text("progress\n" + json.dumps(_report()) + "\n")
    assert summarize.main(["targets", str(ok)]).startswith("TTFT official")


def test_fusions_line_says_what_each_fusion_gains():
    """The fusions phase's line: the fresh-process runs with every fusion on (their mean and spread), then each run
    that turns some off, as ms/step and as how much slower it is (the fusion's gain; negative where it costs), with
    its decode drift from the one-process drift run."""
    def run(v, b1, b8, **extra):
        return {"settings": {"DEEPINFER_DECODE_FUSIONS": v, "DEEPINFER_POLICY": "official"},
                "decode": [{"batch": 1, "ms_per_step": b1}, {"batch": 8, "ms_per_step": b8}], **extra}

    runs = [run("on", 0.99, 2.0, decode_ops={"batch": 1, "ops_per_step": 98, "kernels_per_step": 140.0}),
            run("off", 1.05, 2.02), run("-q_norm_sparse_attn_fp8", 0.99, 2.0), run("on", 1.01, 2.0)]
    drift_run = {"against": [
        {"settings": {"DEEPINFER_DECODE_FUSIONS": "off"}, "decode_drift": {"rel_err": 0.0, "top1_agree": 1.0}},
        {"settings": {"DEEPINFER_DECODE_FUSIONS": "-q_norm_sparse_attn_fp8"},
         "decode_drift": {"rel_err": 2e-3, "top1_agree": 0.875}}]}
    assert summarize.fusions(drift_run, runs).split("; ") == [
        "on (2 runs): B=1 1.000 (spread 2.0%) B=8 2.000 (spread 0.0%), 98 ops, 140 kernels per B=1 step",
        "off: B=1 1.050 (+5.0%) B=8 2.020 (+1.0%), decode drift rel 0.0e+00, top-1 100%",
        "-q_norm_sparse_attn_fp8: B=1 0.990 (-1.0%) B=8 2.000 (+0.0%), decode drift rel 2.0e-03, top-1 88%"]
    assert summarize.fusions({}, [{"error": "cut off"}]) == "no report (no run has decode rows)"
    assert summarize.fusions({}, runs[1:3]) == "no report (no run with every fusion on)"


def test_entries_line_carries_both_drifts():
    """Each configuration of a run with its TTFT and decode rows, and for an --against entry its drift from the main
    logits: the prompt's and the decode steps'."""
    r = _report()
    r["backend"] = "triton"
    r["against"][0]["drift"] = {"rel_err": 1e-3, "top1_agree": 0.98, "flips": 1, "max_flip_margin": 0.01}
    r["against"][0]["decode_drift"] = {"rel_err": 0.0, "top1_agree": 1.0, "positions": 8}
    parts = summarize.entries(r).split(" || ")
    assert parts[0].startswith("triton: TTFT 42.7 ms (3.35x), graph 42.5 (3.33x")
    assert parts[1].endswith("; drift rel 1.00e-03, top-1 98%, flips 1 (main margin <= 0.01), "
                             "decode steps rel 0.00e+00, top-1 100%")
    assert "drift" not in parts[2]


def test_prefill_profile_clause_names_the_top_ops_the_rest_and_the_gaps():
    ops = [{"op": "grouped_gemm", "ms": 16.9, "compute": True, "of_ceiling": 0.2, "ceiling": "fp8"},
           {"op": "hc_post", "ms": 1.0, "compute": False, "of_ceiling": None, "ceiling": "bf16"},
           {"op": "rms_norm", "ms": 0.5, "compute": False, "of_ceiling": None, "ceiling": "bf16"},
           {"op": "rope", "ms": 0.25, "compute": False, "of_ceiling": None, "ceiling": "bf16"}]
    r = {"prefill_ops": {"total_ms": 20.0, "ops": ops, "outside_ops_ms": 1.35}}
    assert summarize.prefill_ops(r, top=2) == ("; prefill profile 20.0 ms: grouped_gemm 16.90 (20% fp8), hc_post 1.00, "
                                               "2 other ops 0.75, between ops 1.35")
    ops[1]["x_bytes"] = 4.25  # hc_post took 4.25x the time of one pass over its tensors' bytes
    assert summarize.prefill_ops(r, top=2) == ("; prefill profile 20.0 ms: grouped_gemm 16.90 (20% fp8), hc_post 1.00 "
                                               "(4.2x bytes), 2 other ops 0.75, between ops 1.35")
    r["prefill_ops"]["host_caught_up"] = True
    assert "(host caught up: includes launch gaps)" in summarize.prefill_ops(r)
    assert summarize.prefill_ops({}) == ""


def test_bench_line_reads_a_cpu_report_and_a_broken_one_is_a_row(tmp_path):
    """A CPU report (no device time, prefill graphs skipped) summarises; a report the script cannot read gives
    "no report (...)" instead of a traceback that would leave the table without its row."""
    r = {"prefill": {"ttft_ms": 43.6, "ratio": 11.39, "floor": {"floor_ms": 3.83}, "host_issue_ms": 43.6,
                     "device_ms": None},
         "prefill_graphs": {"skipped": "prefill graphs need CUDA"},
         "decode": [{"batch": 1, "ms_per_step": 53.0, "ratio": 21.1}]}
    assert summarize.bench(r) == ("TTFT eager 43.6 ms (11.39x floor 3.83; host 43.6, device nan); graph skipped "
                                  "(prefill graphs need CUDA); decode B=1 53.000 ms (21.10x)")
    r["decode_ops"] = {"batch": 1, "ops_per_step": 84, "torch_ops_per_step": 1}  # a report from before the prefill's
    assert summarize.bench(r).endswith("(21.10x); launches: decode B=1 84 ops + 1 torch")
    r["prefill_launches"] = {"tokens": 4096, "ops": 116, "torch_ops": 124}
    assert summarize.bench(r).endswith("decode B=1 53.000 ms (21.10x); launches: prefill 116 ops + 124 torch, "
                                       "decode B=1 84 ops + 1 torch")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"prefill": {"ttft_ms": 1.0}, "decode": []}))
    assert summarize.main(["bench", str(bad)]).startswith("no report (summarize.py bench failed: KeyError")


def test_entries_name_a_skipped_graph():
    r = {"backend": "torch", "prefill": {"ttft_ms": 43.6, "ratio": 11.39}, "prefill_graphs": {"skipped": "no CUDA"},
         "decode": [{"batch": 1, "ms_per_step": 53.0}], "against": []}
    assert summarize.entries(r) == "torch: TTFT 43.6 ms (11.39x), graph skipped; B=1 53.000"


def test_sweeps_name_the_fastest_and_the_agreement(tmp_path):
    fp4 = {"rows": [{"shape": "w1|w3", "batch": 1, "variant": "shipped", "us": 30.0},
                    {"shape": "w1|w3", "batch": 1, "variant": "4 sub-steps", "us": 27.0},
                    {"shape": "w1|w3", "batch": 64, "variant": "shipped", "us": 700.0},
                    {"shape": "w1|w3", "batch": 64, "variant": "4 sub-steps", "us": 720.0}]}
    row = lambda shape, v, mode, ms, differ: {"shape": shape, "variant": v, "mode": mode, "ms": ms,  # noqa: E731
                                               "differ_from_exact": differ, "rel_err": 1e-3, "nan": False}
    fp8 = {"rows": [row("a", "exact", "exact", 2.0, 0.0), row("b", "exact", "exact", 4.0, 0.0),
                    row("a", "exact-wgmma 64x128", "exact-wgmma", 1.0, 0.0),
                    row("b", "exact-wgmma 64x128", "exact-wgmma", 1.0, 0.001),
                    row("a", "exact-wgmma 128x128", "exact-wgmma", 2.0, 0.0),
                    row("b", "exact-wgmma 128x128", "exact-wgmma", 2.0, 0.0),
                    {"shape": "a", "variant": "cublas (per 128-K)", "mode": "cublas", "error": "RuntimeError: x"}]}
    parts = summarize.sweeps(fp4, fp8).split("; ")
    assert parts[0] == "fp4 w1|w3 B=1: 4 sub-steps 27.0 us (0.90x shipped 30.0 us)"
    assert parts[1] == "fp4 w1|w3 B=64: shipped 700.0 us"
    # geomean of exact / form: sqrt(2 * 4) = 2.83 and sqrt(1 * 2) = 1.41
    assert parts[2] == "fp8 exact-wgmma 64x128: 2.83x exact over 2 shapes, outputs off exact's <= 0.10%, rel err <= 1.0e-03"
    assert parts[3].startswith("fp8 exact-wgmma 128x128: 1.41x exact")
    assert parts[4:] == ["best exact-wgmma tiling: exact-wgmma 64x128", "fp8 not run: cublas (per 128-K)"]
    p4, p8 = tmp_path / "a.json", tmp_path / "b.json"
    p4.write_text(json.dumps(fp4))
    assert summarize.main(["sweeps", str(p4), str(p8)]).endswith("fp8 exact sweep: no timed rows (" +
                                                                 summarize._whole(str(p8))["error"] + ")")


def test_a_cut_off_report_says_where_it_stopped(tmp_path):
    r = _report()
    r["cut_off"] = "SIGTERM during: decode: batch 64, 32 steps ..."
    p = tmp_path / "cut.json"
    p.write_text(json.dumps(r))
    line = summarize.main(["targets", str(p)])
    assert line.startswith("TTFT official") and line.endswith("[cut off: SIGTERM during: decode: batch 64, 32 steps ...]")
    p.write_text(json.dumps(_report()))
    assert "cut off" not in summarize.main(["targets", str(p)])
