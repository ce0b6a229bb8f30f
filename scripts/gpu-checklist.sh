#!/usr/bin/env bash
# The GPU checklist of the in-tree patch's PR text (docs/upstream-patch.md), as one
# command for a maintainer with an H100/B200 node:
#
#   scripts/gpu-checklist.sh --sglang-src ~/src/sglang [--model M] [--tp 2,4,8]
#
# On a checkout of SGLang patched with `hicache-async-ack-lab upstream-patch` (the script
# refuses an unpatched one), with this repository's plugin excluded:
#   1. the patch's own tests (CPU, gloo);
#   2. per TP size, one server per arm (blocking: SGLANG_ENABLE_HICACHE_ASYNC_ACK_SYNC=0,
#      pipelined: the default), on 127.0.0.1, driven by SGLang's bench_serving with a
#      shared-prefix workload that overflows the device pool into the host pool;
#   3. pass/fail on what must hold: every TP rank logs the path its arm chose, no rank
#      stops on a disagreement, greedy outputs are identical across arms; and the figures
#      (output tok/s, TTFT and ITL p50/p99, pipelined vs blocking) printed, not asserted.
# Writes everything under --out (default ./gpu-checklist-<date>); exits 1 if a pass/fail
# item fails. --dry-run prints the commands instead of running them.
set -euo pipefail

SRC=""
MODEL="meta-llama/Llama-3.1-8B-Instruct"
TPS="2,4,8"
OUT="gpu-checklist-$(date -u +%Y%m%dT%H%M%SZ)"
PY="${PYTHON:-python3}"
DRY=0
PROMPTS=256
START_TIMEOUT_S=900
BENCH_TIMEOUT_S=1800

usage() { sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
    case "$1" in
        --sglang-src) SRC="$2"; shift 2 ;;
        --model) MODEL="$2"; shift 2 ;;
        --tp) TPS="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        --prompts) PROMPTS="$2"; shift 2 ;;
        --dry-run) DRY=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "unknown argument: $1" >&2; usage >&2; exit 2 ;;
    esac
done
[[ -n "$SRC" ]] || { echo "--sglang-src DIR (a patched checkout of SGLang) is required" >&2; exit 2; }

run() {  # print, and run unless --dry-run
    echo "+ $*"
    [[ "$DRY" == 1 ]] || "$@"
}

# The plugin must not run next to the patched tree (it would stand down anyway).
export SGLANG_PLUGINS="none_selected"
export PYTHONPATH="$SRC/python${PYTHONPATH:+:$PYTHONPATH}"
MODULE="sglang.srt.mem_cache.unified_cache.hicache_ack_sync"
if [[ "$DRY" != 1 ]]; then
    "$PY" -c "import $MODULE" 2>/dev/null || {
        echo "$SRC is not patched ($MODULE missing): run hicache-async-ack-lab upstream-patch --sglang-src $SRC | git -C $SRC apply" >&2
        exit 1
    }
    nvidia-smi -L >/dev/null || { echo "no GPU visible (nvidia-smi -L failed)" >&2; exit 1; }
fi
mkdir -p "$OUT"
FAIL=0

echo "== 1. the patch's tests"
if [[ "$DRY" == 1 ]]; then
    echo "+ (cd $SRC && $PY -m pytest -q test/registered/unit/mem_cache/test_hicache_ack_sync*.py)"
elif ! (cd "$SRC" && run "$PY" -m pytest -q test/registered/unit/mem_cache/test_hicache_ack_sync.py \
        test/registered/unit/mem_cache/test_hicache_ack_sync_gloo.py) >"$OUT/unit.log" 2>&1; then
    echo "FAIL: the patch's tests (see $OUT/unit.log)"; FAIL=1
else
    echo "pass: the patch's tests"
fi

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

SERVER_PID=""
stop_server() {
    if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -TERM -- "-$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
        kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
    fi
    SERVER_PID=""
}
trap stop_server EXIT

arm() {  # arm TP NAME ENABLE
    local tp="$1" name="$2" enable="$3" port log
    port="$(free_port)"
    log="$OUT/tp$tp-$name.server.log"
    echo "-- TP=$tp $name (SGLANG_ENABLE_HICACHE_ASYNC_ACK_SYNC=$enable), port $port"
    [[ "$DRY" == 1 ]] && { echo "+ launch_server --tp $tp ... ; bench_serving ... ; greedy probe"; return; }
    SGLANG_ENABLE_HICACHE_ASYNC_ACK_SYNC="$enable" setsid "$PY" -m sglang.launch_server \
        --model-path "$MODEL" --tp "$tp" --host 127.0.0.1 --port "$port" \
        --enable-hierarchical-cache --hicache-ratio 2 --mem-fraction-static 0.5 \
        --log-level info >"$log" 2>&1 &
    SERVER_PID=$!
    local up=0
    for _ in $(seq "$START_TIMEOUT_S"); do
        curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && { up=1; break; }
        kill -0 "$SERVER_PID" 2>/dev/null || break
        sleep 1
    done
    if [[ "$up" != 1 ]]; then echo "FAIL: TP=$tp $name did not start (see $log)"; FAIL=1; stop_server; return; fi
    timeout "$BENCH_TIMEOUT_S" "$PY" -m sglang.bench_serving --backend sglang \
        --host 127.0.0.1 --port "$port" --dataset-name generated-shared-prefix \
        --gsp-num-groups 32 --gsp-prompts-per-group $((PROMPTS / 32)) \
        --gsp-system-prompt-len 2048 --gsp-question-len 128 --gsp-output-len 64 \
        --output-file "$OUT/tp$tp-$name.bench.jsonl" >"$OUT/tp$tp-$name.bench.log" 2>&1 \
        || { echo "FAIL: TP=$tp $name bench_serving (see $OUT/tp$tp-$name.bench.log)"; FAIL=1; }
    # Greedy outputs for a fixed prompt set: must not depend on the arm.
    "$PY" - "$port" >"$OUT/tp$tp-$name.greedy.json" <<'EOF' || { echo "FAIL: TP=$tp $name greedy probe"; FAIL=1; }
import json, sys, urllib.request
port = sys.argv[1]
out = []
for i in range(16):
    body = {"text": f"Item {i}: " + "the quick brown fox " * (40 + i), "sampling_params": {"temperature": 0, "max_new_tokens": 32}}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    out.append(json.load(urllib.request.urlopen(req, timeout=300))["text"])
print(json.dumps(out))
EOF
    stop_server
}

IFS=',' read -r -a TP_LIST <<<"$TPS"
for tp in "${TP_LIST[@]}"; do
    echo "== 2. TP=$tp"
    arm "$tp" blocking 0
    arm "$tp" pipelined 1
done
[[ "$DRY" == 1 ]] && exit 0

echo "== 3. the checklist"
"$PY" - "$OUT" "${TP_LIST[@]}" <<'EOF' || FAIL=1
import json, re, sys
from pathlib import Path
out, tps = Path(sys.argv[1]), sys.argv[2:]
failed = False

def check(ok, what):
    global failed
    print(("pass: " if ok else "FAIL: ") + what)
    failed |= not ok

def last_record(path):
    lines = [l for l in path.read_text().splitlines() if l.strip()] if path.exists() else []
    return json.loads(lines[-1]) if lines else {}

print(f"{'TP':>3} {'arm':<10} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}")
for tp in tps:
    figures = {}
    for arm, want in (("blocking", "blocking"), ("pipelined", "pipelined, depth")):
        log = out / f"tp{tp}-{arm}.server.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        paths = re.findall(r"HiCache ready-count all_reduce: (blocking|pipelined, depth \d)", text)
        check(len(paths) == int(tp) and all(p.startswith(want) for p in paths),
              f"TP={tp} {arm}: every rank logs '{want}' ({len(paths)} of {tp} lines: {sorted(set(paths))})")
        check("Nothing was popped" not in text and "diverged" not in text,
              f"TP={tp} {arm}: no rank stopped on a disagreement")
        r = last_record(out / f"tp{tp}-{arm}.bench.jsonl")
        figures[arm] = r
        print(f"{tp:>3} {arm:<10} {r.get('output_throughput', float('nan')):>10.1f} "
              f"{r.get('median_ttft_ms', float('nan')):>9.1f} {r.get('p99_ttft_ms', float('nan')):>9.1f} "
              f"{r.get('median_itl_ms', float('nan')):>8.2f} {r.get('p99_itl_ms', float('nan')):>8.2f}")
    g = [out / f"tp{tp}-{a}.greedy.json" for a in ("blocking", "pipelined")]
    same = all(p.exists() for p in g) and json.loads(g[0].read_text()) == json.loads(g[1].read_text())
    check(same, f"TP={tp}: greedy outputs identical across arms")
    b, p = figures["blocking"].get("output_throughput"), figures["pipelined"].get("output_throughput")
    if b and p:
        print(f"    TP={tp}: pipelined output tok/s = {100 * p / b:.1f}% of blocking "
              "(the PR expects >= 100%; #39903 measured +21% vs blocking on B200 at TP=8)")
sys.exit(1 if failed else 0)
EOF
echo "results under $OUT"
exit "$FAIL"
