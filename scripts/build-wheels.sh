#!/usr/bin/env bash
# Build the two wheels from this checkout into DIR (default dist/):
#   hicache_async_ack-*.whl      the runtime: the plugin and `hicache-async-ack doctor`,
#                                what GPU nodes install (no dependencies)
#   hicache_async_ack_lab-*.whl  the lab: bench, bench-server, cpu-server,
#                                mooncake-master, upstream-patch, the simulation
# With PYTHON set, that interpreter's pip and setuptools build them (no download);
# otherwise the project's venv (scripts/setup.sh). Prints the wheels' paths.
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
trap 'rm -rf "$work"' EXIT
for project in "$root" "$root/lab"; do
  name=$(basename "$project")
  mkdir -p "$work/$name"
  (cd "$project" && tar --exclude='./lab' --exclude='*.egg-info' --exclude='__pycache__' \
    --exclude='./build' --exclude='./dist' --exclude='./.git' -cf - .) | tar -xf - -C "$work/$name"
  "$py" -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation \
    -w "$out" "$work/$name" >&2
done
ls "$out"/hicache_async_ack-*.whl "$out"/hicache_async_ack_lab-*.whl
