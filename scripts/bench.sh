#!/usr/bin/env bash
# Set up what is missing, then benchmark on this host:
#   1. the step bench (TP=4 scheduler-like ranks over gloo, 11 ms step), then
#   2. the real server: stock vs plugin, SGLang's launch_server on CPU driven by its
#      own bench_serving, with 0 and 3 ms injected per HiCache all_reduce (~6 min).
#
#   scripts/bench.sh [bench args]                 both
#   scripts/bench.sh --no-server [bench args]     the step bench only
#   scripts/bench.sh --server-only [bench-server args]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$(bash "$root/scripts/setup.sh")
cd "$root"
cli="$venv/bin/hicache-async-ack"
case "${1:-}" in
  --no-server) shift; exec "$cli" bench "$@" ;;
  --server-only) shift; exec "$cli" bench-server "$@" ;;
esac
"$cli" bench "$@"
"$cli" bench-server
