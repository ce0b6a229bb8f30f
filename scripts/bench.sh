#!/usr/bin/env bash
# Set up what is missing, then benchmark on this host:
#   1. the step bench (TP=4 scheduler-like ranks over gloo, 11 ms step), then
#   2. the real server: stock vs plugin, SGLang's launch_server on CPU driven by its
#      own bench_serving (generated-shared-prefix), 0 and 3.2 ms injected per HiCache
#      all_reduce, 3 rounds, every ratio with its 95% interval (~10 min in all, quiet box).
#
#   scripts/bench.sh [bench args]                 both
#   scripts/bench.sh --no-server [bench args]     the step bench only
#   scripts/bench.sh --server-only [bench-server args]
#   scripts/bench.sh --seed-table [bench-server args]
#       the seed's table: L1, stock, plugin, the zero-sync bound and the local reduce
#       (the plugin's step-late pop without its collective), multi-turn (8 lanes x 6
#       turns, 3 runs per server), 0 and 3.2 ms, TP=2, 5 rounds: 35 server starts
#       (~30 min on a quiet box: 30 took 26 min; add --tp 4)
#   scripts/bench.sh --sweep [bench-server args]
#       how the gain grows with the work: 4, 8, 16, 32 lanes at 3.2 ms, stock, plugin
#       and the bound, 3 rounds, a plot of plugin/stock and plugin/bound: 36 server
#       starts (37 min on a quiet box)
#   scripts/bench.sh --pd [bench-server args]
#       PD disaggregation: a real prefill/decode pair per round, the decode offload
#       sync of stock, the plugin and the bound, each arm's decode serving 0 and 3.2 ms
#       (switched between runs), 5 rounds (docs/bench.md; ~70 min on a quiet box)
#   scripts/bench.sh --shared-prompt [bench-server args]
#       a system prompt stored in Mooncake, 32 requests sharing it per arrival pattern
#       (poisson, dense, burst): L3 queries and keys read per request, TTFT, tok/s for
#       stock, the plugin and read once, 5 rounds (docs/bench.md)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$(bash "$root/scripts/setup.sh")
cd "$root"
cli="$venv/bin/hicache-async-ack-lab"  # the lab's CLI: bench, bench-server
seed_arms=(--workload multiturn --arms l1,stock,plugin,bound,local)
case "${1:-}" in
  --no-server) shift; exec "$cli" bench "$@" ;;
  --server-only) shift; exec "$cli" bench-server "$@" ;;
  --seed-table) shift
    exec "$cli" bench-server "${seed_arms[@]}" --latency-ms 0,3.2 --rounds 5 --runs 3 \
      --out bench-seed-table.jsonl --png bench-seed-table.png "$@" ;;
  --sweep) shift
    exec "$cli" bench-server --workload multiturn --arms stock,plugin,bound \
      --latency-ms 3.2 --lanes 4,8,16,32 --rounds 3 --runs 2 --hicache-ratio 64 \
      --out bench-sweep.jsonl --png bench-sweep.png "$@" ;;
  --pd) shift
    exec "$cli" bench-server --workload pd --tp 2 --arms stock,plugin,bound \
      --latency-ms 0,3.2 --rounds 5 --runs 4 --num-groups 4 --prompts-per-group 4 \
      --system-prompt-len 64 --question-len 32 --output-len 128 --max-concurrency 8 \
      --out bench-pd.jsonl --png bench-pd.png "$@" ;;
  --shared-prompt) shift
    exec "$cli" bench-server --storage mooncake --workload shared-prompt --rounds 5 \
      --out bench-shared-prompt.jsonl --png bench-shared-prompt.png "$@" ;;
esac
"$cli" bench "$@"
"$cli" bench-server
