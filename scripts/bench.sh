#!/usr/bin/env bash
# Set up what is missing, then run the benchmark (default: CPU, TP=4, 11 ms step).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$(bash "$root/scripts/setup.sh")
cd "$root"
exec "$venv/bin/hicache-async-ack" bench "$@"
