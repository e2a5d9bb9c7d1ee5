"""deepinfer.debug.comparators, the one comparator core of `compare` and `ab`: each kind of verdict
(floats within / outside tolerance, NaN and Inf, shape and dtype mismatches, exact integers, index sets,
FP8 codes judged with their scales) and the registry as the source of tolerances."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.debug.comparators import (E4M3_STEP_REL, judge, judge_float, judge_int, judge_scaled_fp8,
                                         judge_sets, set_overlap, tolerance)
from deepinfer.ops.registry import DEFAULT_TOL, REGISTRY, _ensure_reference

_ensure_reference()
NAN, INF = float("nan"), float("inf")


# ------------------------------------------------------------------------------------------- floats
def test_float_within_and_outside_tolerance():
    ref = torch.tensor([1.0, 2.0, 4.0])
    v = judge_float(torch.tensor([1.005, 2.0, 4.0]), ref, (1e-2, 0.0))  # allowed 0.01 at 1.0: half used
    assert v.ok and v.n_bad == 0 and v.kind == "float" and v.n == 3
    assert v.max_abs == pytest.approx(0.005, rel=1e-5) and v.max_rel == pytest.approx(0.005, rel=1e-5)
    assert v.worst_ratio == pytest.approx(0.5, rel=1e-4) and v.worst is None and v.note == ""
    v = judge_float(torch.tensor([1.0, 2.0, 4.06]), ref, (1e-2, 0.0))  # 0.06 against 0.04 allowed
    assert not v.ok and v.n_bad == 1 and v.worst == 2
    assert v.max_abs == pytest.approx(0.06, rel=1e-4) and v.max_rel == pytest.approx(0.015, rel=1e-4)
    assert v.worst_ratio == pytest.approx(1.5, rel=1e-4)
    assert v.rel_err == pytest.approx(0.06 / math.sqrt(21), rel=1e-4)
    assert "1 of 3 element(s) outside tol" in v.note and "worst at [2]" in v.note


def test_sum_and_max_combine_differ_between_the_bounds():
    """"sum": |Δ| <= atol + rtol·|ref| (ab); "max": fails only beyond both atol and rtol·|ref| (compare)."""
    ref, got = torch.tensor([1.0]), torch.tensor([1.015])
    assert judge_float(got, ref, (1e-2, 1e-2), combine="sum").ok  # allowed 0.02
    v = judge_float(got, ref, (1e-2, 1e-2), combine="max")  # allowed 0.01
    assert not v.ok and v.worst_ratio == pytest.approx(1.5, rel=1e-4)
    # near zero the atol decides under both
    assert judge_float(torch.tensor([5e-4]), torch.tensor([0.0]), (1e-2, 1e-3), combine="max").ok
    assert not judge_float(torch.tensor([2e-3]), torch.tensor([0.0]), (1e-2, 1e-3), combine="max").ok


def test_widen_admits_a_larger_per_element_bound():
    ref, got = torch.tensor([1.0, 1.0]), torch.tensor([1.1, 1.1])
    assert not judge_float(got, ref, (0.0, 0.0)).ok
    v = judge_float(got, ref, (0.0, 0.0), widen=torch.tensor([0.2, 0.05]))
    assert not v.ok and v.n_bad == 1 and v.worst == 1
    assert judge_float(got, ref, (0.0, 0.0), widen=torch.tensor([0.2, 0.2])).ok


def test_nan_never_passes_and_inf_needs_the_same_inf():
    ref = torch.tensor([1.0, 2.0])
    v = judge_float(torch.tensor([1.0, NAN]), ref, (0.5, 0.5))
    assert not v.ok and v.n_bad == 1 and v.worst == 1 and "NaN" in v.note
    v = judge_float(torch.tensor([NAN, 2.0]), torch.tensor([NAN, 2.0]), (0.5, 0.5))
    assert not v.ok and v.n_bad == 1, "NaN against NaN is no agreement"
    # a poisoned buffer: NaN must stay exactly where the reference left it
    assert judge_float(torch.tensor([NAN, 2.0]), torch.tensor([NAN, 2.0]), (0.0, 0.0), nan_equal=True).ok
    assert not judge_float(torch.tensor([1.0, 2.0]), torch.tensor([NAN, 2.0]), (0.5, 0.5), nan_equal=True).ok
    assert not judge_float(torch.tensor([NAN, 2.0]), torch.tensor([1.0, 2.0]), (0.5, 0.5), nan_equal=True).ok
    # masked scores: -inf against -inf is equal; -inf against +inf is not
    assert judge_float(torch.tensor([0.5, -INF]), torch.tensor([0.5, -INF]), (0.0, 0.0)).ok
    v = judge_float(torch.tensor([0.5, -INF]), torch.tensor([0.5, INF]), (0.5, 0.5))
    assert not v.ok and "inf mismatch" in v.note
    # a statistic verdict does not hide a NaN
    assert not judge_float(torch.tensor([1.0, NAN, 1.0]), torch.ones(3), (0.5, 0.5), stat="mean").ok


def test_shape_and_dtype_mismatch_are_clear_failures():
    v = judge_float(torch.zeros(2, 3), torch.zeros(3, 2), (1.0, 1.0))
    assert not v.ok and v.kind == "shape" and "[2, 3]" in v.note and "[3, 2]" in v.note
    v = judge(torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4), (1.0, 1.0))
    assert not v.ok and v.kind == "dtype" and "bfloat16" in v.note
    assert judge(torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4), (1.0, 1.0), strict_dtype=False).ok
    assert judge_int(torch.zeros(3, dtype=torch.long), torch.zeros(4, dtype=torch.long)).kind == "shape"


def test_stat_mode_judges_one_statistic():
    ref = torch.ones(100)
    got = ref.clone()
    got[0] = 2.0  # one outlier: max |Δ| 1, mean 0.01
    assert not judge_float(got, ref, (0.0, 0.0)).ok
    v = judge_float(got, ref, (0.02, 0.0), stat="mean")
    assert v.ok and v.stats.stat_value == pytest.approx(0.01) and v.stats.stat_bound == pytest.approx(0.02)
    assert not judge_float(got, ref, (0.005, 0.0), stat="mean").ok
    assert not judge_float(got, ref, (0.5, 0.0), stat="max").ok


# ----------------------------------------------------------------------------------------- integers
def test_integers_are_exact():
    ref = torch.tensor([[1, 2, 3], [4, 5, 6]])
    v = judge(ref.clone(), ref)
    assert v.ok and v.kind == "int" and v.n_bad == 0 and v.max_abs == 0.0
    got = ref.clone()
    got[1, 2] = 7
    v = judge(got, ref, (1.0, 1.0))  # a tolerance does not loosen integers
    assert not v.ok and v.n_bad == 1 and v.worst == 5 and v.max_abs == 1.0
    assert v.note == "1 element(s) differ in 1 row(s)"
    assert not judge_int(ref.flip(-1), ref).ok, "a permuted plain integer tensor is not a set"
    assert judge_int(torch.empty(2, 0, dtype=torch.long), torch.empty(2, 0, dtype=torch.long)).ok


# -------------------------------------------------------------------------------------- index sets
def test_index_sets_equal_in_another_order_pass():
    ref = torch.tensor([[1, 2, 3], [7, -1, -1], [-1, -1, -1]])
    got = torch.tensor([[3, 1, 2], [-1, 7, -1], [-1, -1, -1]])
    v = judge_sets(got, ref)
    assert v.ok and v.kind == "set" and v.n_bad == 0
    assert judge(got, ref, as_set=True).ok and not judge(got, ref).ok
    assert judge_sets(got, ref, min_overlap=1.0).ok


def test_index_sets_that_differ_fail():
    ref = torch.tensor([[1, 2, 3], [7, -1, -1]])
    v = judge_sets(torch.tensor([[1, 2, 4], [7, -1, -1]]), ref)
    assert not v.ok and v.n_bad >= 1 and "in 1 row(s)" in v.note
    assert not judge_sets(torch.tensor([[1, 2, 3], [7, 8, -1]]), ref).ok, "an extra selection in a hole"
    assert not judge_sets(torch.tensor([[3, 3, 1], [7, -1, -1]]), ref).ok, "a duplicate is no set"
    v = judge_sets(torch.tensor([[1, 2, 4], [7, -1, -1]]), ref, min_overlap=1.0)
    assert not v.ok and v.n_bad == 1 and v.worst == 0 and v.note == "row [0]: [1, 2, 4] vs [1, 2, 3]"
    assert judge_sets(torch.tensor([[1, 2, 4], [7, -1, -1]]), ref, min_overlap=0.6).ok  # 2 of 3
    assert judge_sets(torch.tensor([[1, 2, 4], [7, -1, -1]]), ref, min_overlap=0.6).stats.overlap.tolist() \
        == pytest.approx([2 / 3, 1.0])


def test_empty_index_rows():
    """-1 rows and rows with no slot at all (a CSA layer before its first compressed entry: k = 0)."""
    empty = torch.empty(2, 4, 0, dtype=torch.long)
    assert judge_sets(empty, empty.clone()).ok
    v = judge_sets(empty, empty.clone(), min_overlap=1.0)
    assert v.ok and v.n == 8 and set_overlap(empty, empty).tolist() == [1.0] * 8
    holes = torch.full((3, 2), -1)
    assert judge_sets(holes, holes.clone(), min_overlap=1.0).ok
    # an empty reference row needs an empty row; an empty row against a set misses it
    ref = torch.tensor([[-1, -1], [4, 5]])
    assert not judge_sets(torch.tensor([[3, -1], [4, 5]]), ref, min_overlap=0.5).ok
    assert not judge_sets(torch.tensor([[-1, -1], [-1, -1]]), ref, min_overlap=0.5).ok
    # the widths may differ in min_overlap mode (k' = min(topk, T)), the rows may not
    assert judge_sets(torch.tensor([[-1], [5]]), torch.tensor([[-1, -1], [5, -1]]), min_overlap=1.0).ok
    assert judge_sets(torch.zeros(3, 2, dtype=torch.long), torch.zeros(2, 2, dtype=torch.long),
                      min_overlap=1.0).kind == "shape"


# --------------------------------------------------------------------------------------- scaled FP8
def _blocks(codes, scales):
    q = torch.tensor(codes, dtype=torch.float32).to(torch.float8_e4m3fn).view(1, -1)
    return q, torch.tensor([scales], dtype=torch.float32)


BASE = [448.0, 96.0] + [1.0] * 126


def test_fp8_power_of_two_flip_is_accepted():
    q_r, s_r = _blocks(BASE, [1.0])
    q_g, s_g = _blocks([224.0, 48.0] + [0.5] * 126, [2.0])  # the same values on the coarser scale
    vq, vs = judge_scaled_fp8(q_g, q_r, s_g, s_r, 128)
    assert vq.ok and vq.kind == "fp8" and vq.max_abs == 0.0
    assert vs.ok and vs.n_excused == 1 and "flipped" in vs.note
    vq, vs = judge_scaled_fp8(q_r, q_g, s_r, s_g, 128)  # and the other way round
    assert vq.ok and vs.ok and vs.n_excused == 1


def test_fp8_other_scale_differences_and_values_are_rejected():
    q_r, s_r = _blocks(BASE, [1.0])
    q4, s4 = _blocks([112.0, 24.0] + [0.25] * 126, [4.0])  # same values, factor 4: no flip
    vq, vs = judge_scaled_fp8(q4, q_r, s4, s_r, 128)
    assert vq.ok and not vs.ok and vs.n_bad == 1 and vs.n_excused == 0
    q_lo, s_lo = _blocks([200.0, 48.0] + [0.5] * 126, [2.0])  # ratio 2 but the finer amax is not at 448
    q_r2, s_r2 = _blocks([400.0, 96.0] + [1.0] * 126, [1.0])
    assert not judge_scaled_fp8(q_lo, q_r2, s_lo, s_r2, 128)[1].ok
    q_bad, _ = _blocks([448.0, 128.0] + [1.0] * 126, [1.0])  # one value a third off
    vq, vs = judge_scaled_fp8(q_bad, q_r, s_r, s_r, 128)
    assert not vq.ok and vq.n_bad == 1 and vq.worst == 1 and vs.ok
    assert vq.worst_ratio > 1 and vq.max_abs == 32.0
    q_one, _ = _blocks([448.0, 104.0] + [1.0] * 126, [1.0])  # one e4m3 step (96 -> 104) passes
    assert judge_scaled_fp8(q_one, q_r, s_r, s_r, 128)[0].ok
    q_nan = q_r.clone()
    q_nan.view(torch.uint8)[0, 5] = 0x7F  # the e4m3 NaN code
    assert not judge_scaled_fp8(q_nan, q_r, s_r, s_r, 128)[0].ok
    assert not judge_scaled_fp8(q_r, q_r, torch.tensor([[NAN]]), s_r, 128)[1].ok


def test_fp8_rtol_comes_from_the_registry():
    q_r, s_r = _blocks(BASE, [1.0])
    q_one, _ = _blocks([448.0, 104.0] + [1.0] * 126, [1.0])  # 8.3 % off
    rtol = REGISTRY["rms_norm_quant"].tol["float8_e4m3fn"][0]
    assert judge_scaled_fp8(q_one, q_r, s_r, s_r, 128, op="rms_norm_quant")[0].ok and rtol == E4M3_STEP_REL
    assert not judge_scaled_fp8(q_one, q_r, s_r, s_r, 128, (0.05, 0.0))[0].ok


# -------------------------------------------------------------------------------------- tolerances
def test_registry_is_the_source_of_tolerances():
    for op, d in REGISTRY.items():
        for dt, tol in d.tol.items():
            assert tolerance(op, dt) == tuple(tol)
    assert tolerance("act_quant", torch.float8_e4m3fn) == (0.0, 0.0)
    assert tolerance("rms_norm", torch.float8_e4m3fn) == (0.0, 0.0)  # no entry: exact
    assert tolerance(None, torch.bfloat16) == DEFAULT_TOL["bfloat16"]
    assert tolerance(None, "int64") == (0.0, 0.0)
    with pytest.raises(KeyError):
        tolerance("no_such_op", torch.float32)
    # judged with the op's tolerance for the reference's dtype
    ref = torch.ones(8)
    got = ref * (1 + 1e-4)
    assert not judge(got, ref, op="rms_norm").ok  # float32 (1e-5, 1e-6)
    got = ref * 1.015
    assert not judge(got, ref, op="rms_norm").ok
    assert judge(got.bfloat16(), ref.bfloat16(), op="rms_norm").ok  # bfloat16 (2e-2, 1e-2)
    rtol = REGISTRY["moe_route"].tol["float32"][0]
    assert judge(ref * (1 + 0.5 * rtol), ref, op="moe_route").ok and not judge(ref * (1 + 2 * rtol), ref,
                                                                              op="moe_route").ok


def test_bad_tolerances_are_refused():
    with pytest.raises(ValueError):
        judge_float(torch.ones(1), torch.ones(1), (-1.0, 0.0))
    with pytest.raises(ValueError):
        judge_float(torch.ones(1), torch.ones(1), (NAN, 0.0))
    with pytest.raises(ValueError):
        judge_float(torch.ones(1), torch.ones(1), (0.1, 0.0), combine="avg")


def test_rel_norm():
    from deepinfer.debug.comparators import rel_norm

    a = torch.tensor([3.0, 4.0])
    assert rel_norm(a, a) == 0.0 and rel_norm(torch.zeros(2), torch.zeros(2)) == 0.0
    assert abs(rel_norm(a * 1.1, a) - 0.1) < 1e-6  # 1.1 in float32
    assert rel_norm(a, torch.zeros(2)) == float("inf")
    assert rel_norm(torch.tensor([float("nan"), 1.0]), a) == float("inf")
    assert rel_norm(a, torch.tensor([float("nan"), 1.0])) == float("inf")
