#!/usr/bin/env bash
# Does SGLang release X behave like a tested one? Fetches its wheel (pip download
# --no-deps, cached under ~/.cache/hicache-async-ack/wheels) and compares each
# fingerprint with the recorded table; exits 0 when every method matches one
# tested release. Usage: scripts/check-sglang-release.sh 0.5.24 [--diff]
# What to do next: docs/versions.md, "When SGLang releases".
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ $# -lt 1 ]; then
  echo "usage: $0 RELEASE [--diff]" >&2
  exit 2
fi
venv=$(bash "$root/scripts/setup.sh")
exec "$venv/bin/python" -m hicache_async_ack_lab.releases check "$@"
