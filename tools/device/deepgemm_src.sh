#!/usr/bin/env bash
# Packs .device/deepgemm-src.tar.xz: DeepGEMM's source at its pinned commit with its two submodules filled in
# (CUTLASS's headers only, fmt), from the `fetch` tool's mirrors, for tools/device/deepgemm.sh to build on a GPU
# machine (which cannot download). Step 1 of tools/device/DEEPGEMM.md.
#   bash tools/device/deepgemm_src.sh [MIRROR_ROOT]      # default /work/.mirror; fetch the three repositories first:
#   deepseek-ai/DeepGEMM, NVIDIA/cutlass, fmtlib/fmt (the gitlinks of DeepGEMM's third-party/)
set -euo pipefail
root=$(git rev-parse --show-toplevel)
mirror=${1:-/work/.mirror}
DG=54e22612409371d6364144b69086735beb54e98b        # deep_gemm/__init__.py: __version__ = '2.6.1'
CUTLASS=f3fde58372d33e9a5650ba7b80fc48b3b49d40c8   # DeepGEMM's third-party/cutlass gitlink at $DG
FMT=553ec11ec06fbe0beebfbb45f9dc3c9eabd83d28       # DeepGEMM's third-party/fmt gitlink at $DG
out="$root/.device/deepgemm-src.tar.xz"
mkdir -p "$root/.device"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
git -C "$mirror/deepseek-ai+DeepGEMM/repo" archive --prefix=DeepGEMM/ "$DG" | tar -x -C "$tmp"
# the gitlinks must be the commits named above: a newer DeepGEMM would name others
for pair in "cutlass $CUTLASS" "fmt $FMT"; do
  set -- $pair
  got=$(git -C "$mirror/deepseek-ai+DeepGEMM/repo" ls-tree "$DG" "third-party/$1" | awk '{print $3}')
  [ "$got" = "$2" ] || { echo "DeepGEMM $DG names third-party/$1 at $got, not $2" >&2; exit 2; }
done
# CUTLASS: the headers DeepGEMM's build and JIT include (include/ and tools/util/include), not its 100 MB of rest
git -C "$mirror/NVIDIA+cutlass/repo" archive --prefix=DeepGEMM/third-party/cutlass/ "$CUTLASS" include tools/util/include \
  | tar -x -C "$tmp"
git -C "$mirror/fmtlib+fmt/repo" archive --prefix=DeepGEMM/third-party/fmt/ "$FMT" | tar -x -C "$tmp"
tar -cf - -C "$tmp" DeepGEMM | xz -T0 -6 > "$out.tmp" && mv "$out.tmp" "$out"
ls -la "$out"
