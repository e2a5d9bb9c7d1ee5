#!/usr/bin/env bash
# DeepGEMM on a GPU machine (issue 50, tools/device/DEEPGEMM.md): install it, then check and time the `deepgemm`
# backend, in one call.
#   carry: .device/guided.tar.xz (the tiny model's tokenizer) and either .device/deep_gemm-wheel.tar (the wheel an
#          earlier run left under $OUT: installed as is) or .device/deepgemm-src.tar.xz (DeepGEMM 2.6.1 with CUTLASS's and
#          fmt's headers, 1.4 MB: built here, the wheel left under $OUT/ for the next run)
#   bash tools/device/deepgemm.sh                 # build/install, GPU test, ab, margin (tiny), bench (flash-slice:4)
#   DG_PHASES="ab margin" bash tools/device/deepgemm.sh
# Writes $OUT/dg_*.log|json and prints a table last. GPU_SUITE_LIMIT=560 (seconds for the whole call).
set -uo pipefail
OUT=${OUT:-/tmp/out}
LIMIT=${GPU_SUITE_LIMIT:-560}
PHASES=${DG_PHASES:-"test ab margin bench"}
t_start=$(date +%s)
mkdir -p /tmp/site "$OUT"
for t in .device/*.tar.xz; do
  case $t in *deepgemm-src*) continue ;; esac
  [ -f "$t" ] && tar -xJf "$t" -C /tmp/site
done
export PYTHONPATH=/tmp/site:$PWD DEEPINFER_HOME=/tmp/dh DG_JIT_CACHE_DIR=/tmp/dg-jit
rows=()
row() { rows+=("| $1 | rc $2 | $3 s | ${4//|/ } |"); echo "${rows[-1]}"; }

# 1. install: a carried wheel, else build one from the carried source
t0=$(date +%s)
if [ -f .device/deep_gemm-wheel.tar ]; then
  mkdir -p /tmp/dgw && tar -xf .device/deep_gemm-wheel.tar -C /tmp/dgw
fi
whl=$(ls .device/deep_gemm-*.whl /tmp/dgw/deep_gemm-*.whl 2>/dev/null | head -1)
if [ -z "$whl" ] && [ -f .device/deepgemm-src.tar.xz ]; then
  rm -rf /tmp/dg && mkdir -p /tmp/dg && tar -xJf .device/deepgemm-src.tar.xz -C /tmp/dg
  # no .git there: the version reads 2.6.1+local; DG_USE_LOCAL_VERSION=1 never tries a download
  (cd /tmp/dg/DeepGEMM && DG_USE_LOCAL_VERSION=1 python3 setup.py bdist_wheel) > "$OUT/dg_build.log" 2>&1
  rc=$?
  whl=$(ls /tmp/dg/DeepGEMM/dist/deep_gemm-*.whl 2>/dev/null | head -1)
  # the wheel's name holds a '+' (2.6.1+local), which the device tool does not bring back: inside a tar it comes
  [ -n "$whl" ] && tar -cf "$OUT/deep_gemm-wheel.tar" -C "$(dirname "$whl")" "$(basename "$whl")"
  row build $rc $(( $(date +%s) - t0 )) "$(basename "${whl:-no wheel}") $(du -h "${whl:-/dev/null}" | cut -f1)"
fi
if [ -z "$whl" ]; then
  echo "no DeepGEMM wheel or source carried (.device/deep_gemm-*.whl or .device/deepgemm-src.tar.xz)"; exit 2
fi
# --upgrade: a warm machine's earlier copy is replaced, so the wheel tested is this one
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "$whl" \
  > "$OUT/dg_install.log" 2>&1 || { echo "installing $whl failed: $(tail -1 "$OUT/dg_install.log")"; exit 2; }
python3 - <<'PY' | tee "$OUT/dg_versions.txt"
import subprocess, torch
import deep_gemm
nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1:]
print(f"deep_gemm {deep_gemm.__version__}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"nvcc {' '.join(nvcc)}, {torch.cuda.get_device_name()}")
PY
python3 -c "from deepinfer.tiny import ensure_tiny_model; ensure_tiny_model(progress=False)"

left() { echo $(( LIMIT - ($(date +%s) - t_start) )); }
di() { timeout "$(left)" python3 -m deepinfer "$@"; }
for phase in $PHASES; do
  [ "$(left)" -lt 30 ] && { rows+=("| $phase | not run: $(left) s left | | |"); continue; }
  # every variant of the selftest crashed: the later phases would crash in the same call, so they are named, not run
  if [ "$phase" != selftest ] && [ -f "$OUT/dg_selftest.log" ] && ! grep -q "^later phases run with" "$OUT/dg_selftest.log"; then
    rows+=("| $phase | not run: no selftest variant ran | | |"); continue
  fi
  t0=$(date +%s)
  case $phase in
    selftest)  # one fp8_gemm_nt straight on deep_gemm, in a child with faulthandler, with the JIT's own log;
      # then DeepGEMM's own FP8 test (where its sources were unpacked).
      # variants: nvcc, NVRTC, and torch's own cuBLASLt handle instead of the one DeviceRuntime's constructor
      # creates (DG_USE_PYTORCH_CUBLASLT_HANDLE=1, DeepGEMM's switch); the first variant that runs is exported to
      # the later phases
      for v in "DG_JIT_USE_NVRTC=0" "DG_JIT_USE_NVRTC=1" "DG_USE_PYTORCH_CUBLASLT_HANDLE=1"; do
        env $v DG_JIT_DEBUG=1 DG_JIT_PRINT_COMPILER_COMMAND=1 timeout 90 python3 -X faulthandler - \
          > "$OUT/dg_selftest_${v/=/_}.log" 2>&1 <<'PY'
import torch, deep_gemm
torch.manual_seed(0)
M, N, K = 128, 256, 512
a = torch.randn(M, K, device="cuda").to(torch.float8_e4m3fn)
b = torch.randn(N, K, device="cuda").to(torch.float8_e4m3fn)
sa = torch.ones(M, K // 128, device="cuda")
sb = torch.ones(N // 128, K // 128, device="cuda")
d = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
print("calling fp8_gemm_nt", flush=True)
deep_gemm.fp8_gemm_nt((a, sa), (b, sb), d)
torch.cuda.synchronize()
ref = a.float() @ b.float().t()
print("max rel err", float((d.float() - ref).abs().max() / ref.abs().max()), flush=True)
PY
        vrc=$?
        echo "$v rc=$vrc $(grep -E "max rel err|Segmentation|Error" "$OUT/dg_selftest_${v/=/_}.log" | head -1)"
      done > "$OUT/dg_selftest.log"
      works=$(grep -m1 -oE "^DG_[A-Z_]+=[01] rc=0" "$OUT/dg_selftest.log" | cut -d' ' -f1)
      [ -n "$works" ] && export "$works" && echo "later phases run with $works" >> "$OUT/dg_selftest.log"
      # a crash in DeepGEMM's host code (2026-12-06: before any JIT compile, nvcc and NVRTC alike): where, from
      # cuda-gdb, which also debugs host code (the image has no gdb)
      # no variant ran: which step of the host path fails first (tools/device/dg_bisect.py, a child per step)
      [ -z "$works" ] && timeout 400 python3 tools/device/dg_bisect.py >> "$OUT/dg_selftest.log" 2>&1
      if grep -q "rc=139" "$OUT/dg_selftest.log"; then
        sed -n "/^import torch, deep_gemm$/,/^print(\"max rel err/p" "$0" > /tmp/dg_self.py
        timeout 120 cuda-gdb -batch -ex run -ex bt -ex "info sharedlibrary deep_gemm" --args python3 /tmp/dg_self.py \
          > "$OUT/dg_backtrace.log" 2>&1
        echo "backtrace: $(grep -m3 -E "^#[0-9]" "$OUT/dg_backtrace.log" | tr '\n' ' ')" >> "$OUT/dg_selftest.log"
        # DeviceRuntime's constructor creates its own cuBLASLt handle: which libcublasLt / cudart the extension
        # resolves beside the ones torch loaded (two versions in one process is a suspect)
        { ldd /tmp/site/deep_gemm/_C*.so | grep -E "cublas|cudart|nvrtc|torch"
          python3 -c "import torch; torch.zeros(1, device='cuda') @ torch.zeros(1, 1, device='cuda').view(1)
print(''.join(sorted({l.split()[-1] + chr(10) for l in open('/proc/self/maps') if 'cublas' in l or 'cudart' in l})))"
        } > "$OUT/dg_libs.log" 2>&1
      fi
      if [ -f /tmp/dg/DeepGEMM/tests/test_fp8_fp4.py ]; then
        (cd /tmp/dg/DeepGEMM && timeout 90 python3 -X faulthandler tests/test_fp8_fp4.py) > "$OUT/dg_own_test.log" 2>&1
        echo "DeepGEMM's tests/test_fp8_fp4.py rc=$?" >> "$OUT/dg_selftest.log"
      fi
      rc=0; sum=$(tr '\n' ' ' < "$OUT/dg_selftest.log") ;;
    test)
      timeout "$(left)" python3 -m pytest -q -rA -m gpu -p no:cacheprovider tests/test_deepgemm_backend.py \
        > "$OUT/dg_test.log" 2>&1
      rc=$?; sum=$(grep -E "(passed|failed|skipped|error).* in [0-9.]+s" "$OUT/dg_test.log" | tail -1) ;;
    ab)  # DeepGEMM's GEMMs against the reference and Triton at flash shapes, timed in one run
      di ab --backend deepgemm --against triton --ops 'gemm' --shapes flash --bench > "$OUT/dg_ab.log" 2>&1
      rc=$?; sum=$(tail -3 "$OUT/dg_ab.log" | tr '\n' ' ') ;;
    margin)  # deepinfer-tiny: the FP4 experts requantised (experts=fp8) on Triton, then on DeepGEMM, vs lossless
      ops="op.fp8_gemm=deepgemm,op.fp4_gemm=deepgemm,op.grouped_gemm=deepgemm"
      di margin "北京是中国的首都" --steps 16 --ref backend=triton --test backend=triton,experts=fp8 --json \
        > "$OUT/dg_margin_requant.json" 2> "$OUT/dg_margin.log"
      rc1=$?
      di margin "北京是中国的首都" --steps 16 --ref backend=triton --test "backend=triton,experts=fp8,$ops" --json \
        > "$OUT/dg_margin_deepgemm.json" 2>> "$OUT/dg_margin.log"
      rc2=$?; rc=$(( rc2 > rc1 ? rc2 : rc1 ))
      sum=$(python3 tools/device/summarize.py margin "$OUT/dg_margin_requant.json" "$OUT/dg_margin_deepgemm.json") ;;
    bench)  # flash-slice:4, Triton alone against Triton with DeepGEMM's GEMMs, one run, the same floors
      di bench --preset flash-slice:4 --batch 1,8 --prompt-len 4096 --gen-len 16 --backend triton --device cuda \
        --against deepgemm --json \
        > "$OUT/dg_bench.json" 2> "$OUT/dg_bench.log"
      rc=$?
      sum=$(python3 tools/device/summarize.py against "$OUT/dg_bench.json" triton +deepgemm) ;;
    *) echo "unknown phase $phase"; continue ;;
  esac
  row "$phase" "$rc" $(( $(date +%s) - t0 )) "$sum"
  grep -E "^(FAILED|ERROR)" "$OUT/dg_$phase.log" 2>/dev/null | head -5
done
echo; cat "$OUT/dg_versions.txt"
echo "| phase | rc | wall | result |"
printf '%s\n' "${rows[@]}"
