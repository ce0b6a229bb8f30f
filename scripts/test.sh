#!/usr/bin/env bash
# Set up what is missing, then run the whole test suite (what .ci/run calls).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$(bash "$root/scripts/setup.sh")
cd "$root"
exec "$venv/bin/python" -m pytest test "$@"
