#!/usr/bin/env bash
# Builds .device/extras.tar.xz: what the GPU tests import beyond the shared site (make-site.sh) -- jsonschema
# and its dependencies (rpds-py is a binary wheel) for the H200's Python 3.12, x86-64. Unpack it beside the
# site:  tar -xJf .device/extras.tar.xz -C /tmp/site
set -euo pipefail
root=$(git rev-parse --show-toplevel)
out="$root/.device/extras.tar.xz"
[ -f "$out" ] && { echo "exists: $out"; exit 0; }
mkdir -p "$root/.device"
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
ls -la "$out"
