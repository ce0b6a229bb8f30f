#!/usr/bin/env bash
# Build the two wheels from this checkout into DIR (default dist/):
#   hicache_async_ack-*.whl      the runtime: the plugin and `hicache-async-ack doctor`,
#                                what GPU nodes install (no dependencies)
#   hicache_async_ack_lab-*.whl  the lab: bench, bench-server, cpu-server,
#                                mooncake-master, upstream-patch, differential
# With the interpreter PYTHON (default python3; any Python >= 3.10 with pip) through
# `pip wheel` with build isolation: pip fetches the build backend (setuptools) from
# the package index into a throw-away environment. Nothing else is installed or set
# up (no venv, no SGLang, no apt). Prints the two wheels' paths.
#   scripts/build-wheels.sh [DIR]            PYTHON=python3.10 scripts/build-wheels.sh
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:-$root/dist}
py=${PYTHON:-python3}
if ! command -v "$py" >/dev/null 2>&1; then
  echo "build-wheels: $py not found; set PYTHON to a Python >= 3.10 that has pip" >&2
  exit 1
fi
if ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  echo "build-wheels: $py is Python $("$py" -c 'import platform; print(platform.python_version())')," \
    "the wheels need >= 3.10; set PYTHON to another interpreter" >&2
  exit 1
fi
if ! "$py" -m pip --version >/dev/null 2>&1; then
  echo "build-wheels: $py has no pip: install it (python3 -m ensurepip, or Debian's" \
    "python3-pip) or set PYTHON to an interpreter that has it" >&2
  exit 1
fi
mkdir -p "$out"
out=$(cd "$out" && pwd)
# A fresh copy of what each project builds from: setuptools writes build/ and
# *.egg-info next to the sources, and an old build/ can carry files that no longer
# exist. -h: the lab's LICENSE is a link to the repository's.
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
pids=()
for name in runtime lab; do
  project=$root
  files=(pyproject.toml README.md LICENSE python)
  if [ "$name" = lab ]; then
    project=$root/lab
    files=(pyproject.toml LICENSE python)
  fi
  mkdir -p "$work/$name"
  (cd "$project" && tar -h --exclude='*.egg-info' --exclude='__pycache__' -cf - "${files[@]}") \
    | tar -xf - -C "$work/$name"
  # Both at once: each build is mostly pip's start-up and its isolated environment.
  "$py" -m pip wheel -q --disable-pip-version-check --no-deps \
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
