#!/usr/bin/env bash
# Build the two wheels from this checkout into DIR (default dist/):
#   hicache_async_ack-*.whl      the runtime: the plugin and `hicache-async-ack doctor`,
#                                what GPU nodes install (no dependencies)
#   hicache_async_ack_lab-*.whl  the lab: bench, bench-server, cpu-server,
#                                mooncake-master, upstream-patch, the simulation
# With PYTHON set, that interpreter's pip and setuptools build them (no download);
# otherwise the project's venv (scripts/setup.sh). Prints the two wheels' paths.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:-$root/dist}
py=${PYTHON:-}
if [ -z "$py" ]; then
  py="$(bash "$root/scripts/setup.sh")/bin/python"
fi
mkdir -p "$out"
# A fresh copy of each project: setuptools writes build/ and *.egg-info next to
# the sources, and an old build/ can carry files that no longer exist.
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
pids=()
for name in runtime lab; do
  project=$root
  [ "$name" = lab ] && project=$root/lab
  mkdir -p "$work/$name"
  (cd "$project" && tar --exclude='./lab' --exclude='*.egg-info' --exclude='__pycache__' \
    --exclude='./build' --exclude='./dist' --exclude='./.git' -cf - .) | tar -xf - -C "$work/$name"
  # Both at once: each build is mostly pip's and setuptools' start-up.
  "$py" -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation \
    -w "$work/wheels" "$work/$name" >"$work/$name.log" 2>&1 &
  pids+=("$!")
done
failed=0
for i in 0 1; do
  if ! wait "${pids[$i]}"; then
    name=$([ "$i" = 0 ] && echo runtime || echo lab)
    echo "build-wheels: the $name wheel failed to build:" >&2
    cat "$work/$name.log" >&2
    failed=1
  fi
done
[ "$failed" -eq 0 ]
# Only what was built now (DIR may hold older wheels): the runtime's, then the lab's.
for wheel in "$work"/wheels/*.whl; do
  mv -f "$wheel" "$out/"
  echo "$out/$(basename "$wheel")"
done
