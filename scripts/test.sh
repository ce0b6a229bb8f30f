#!/usr/bin/env bash
# Set up what is missing, then run the test suite against the tested SGLang releases.
#
#   scripts/test.sh                    everything CI needs (what .ci/run calls): the full
#                                      suite on the venv's SGLang (the newest tested), then
#                                      the per-release subset on every other tested release
#                                      (its TP=2/TP=4 gloo runs on the oldest);
#                                      the end-to-end tests (test/e2e) run beside the rest,
#                                      a second pytest (their servers wait on I/O and
#                                      start-up, the rest on gloo ranks: two streams fill a
#                                      2-core box), their log printed when they end
#   scripts/test.sh --sglang 0.5.21 [pytest args]
#                                      one release: the full suite if it is the venv's,
#                                      the per-release subset otherwise
#   scripts/test.sh [pytest args]      the full suite on the venv's SGLang, with these args
#
# Another release runs from an overlay: that wheel alone (pip install --no-deps
# --target), cached outside the checkout and installed once (see
# `python -m hicache_async_ack_lab.releases overlay`), put on PYTHONPATH over the
# venv so that the ranks the tests spawn import it too. Prints how long each part
# took and one closing count; exits non-zero if any part failed.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$(bash "$root/scripts/setup.sh")
py="$venv/bin/python"
cd "$root"
unset PYTHONPATH

# The per-release subset: the version guard, the unit tests on the real class,
# plugin loading through SGLang's real load_plugins(), TP=2 and TP=4 over real gloo.
SUBSET_UNIT=(test/unit/test_upstream.py test/unit/test_sglang_cache.py test/unit/test_plugin_loading.py)
SUBSET=("${SUBSET_UNIT[@]}" test/multirank/test_tp_groups.py)

venv_release=$("$py" -c 'from hicache_async_ack.guard import installed_version as v; print(v())')
logs=$(mktemp -d)
e2e_pid=""
cleanup() {
  [ -z "$e2e_pid" ] || kill -- "-$e2e_pid" 2>/dev/null || true
  rm -rf "$logs"
}
trap cleanup EXIT

count() {  # count WORD LOG: N from pytest's closing line ("3 passed, 1 skipped in 2.0s")
  local line
  line=$(grep -E '^(=+ )?[0-9]+ [a-z]+.* in [0-9.]+s' "$2" | tail -1 || true)
  echo "$line" | grep -oE "[0-9]+ $1" | grep -oE '^[0-9]+' || echo 0
}

run_part() {  # run_part NAME RELEASE [pytest args...]: its log and result under $logs
  local name=$1 release=$2 what="full suite" overlay="" log="$logs/$1.log" rc=0 start=$SECONDS
  shift 2
  local -a args=("$@")
  [ ${#args[@]} -gt 0 ] || args=(test)
  if [ "$release" != "$venv_release" ]; then
    what="release subset"
    [ $# -gt 0 ] || args=("${SUBSET[@]}")
    if ! overlay=$("$py" -m hicache_async_ack_lab.releases overlay "$release"); then
      echo "sglang $release $what ($name): FAILED (no overlay) in $((SECONDS - start)) s|0|1|0" \
        > "$logs/$name.sum"
      return
    fi
  fi
  echo "test.sh: sglang $release, $what ($name)${overlay:+ (overlay $overlay)}"
  if [ "${QUIET:-0}" = 1 ]; then
    PYTHONPATH=$overlay "$py" -m pytest "${args[@]}" > "$log" 2>&1 || rc=$?
  else
    PYTHONPATH=$overlay "$py" -m pytest "${args[@]}" 2>&1 | tee "$log" || rc=$?
  fi
  local p f e s verdict="passed"
  p=$(count passed "$log")
  f=$(count failed "$log")
  e=$(count error "$log")
  s=$(count skipped "$log")
  f=$((f + e))
  if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then
    f=1  # pytest itself failed (collection, no tests, ...)
  fi
  [ "$rc" -eq 0 ] || verdict="FAILED (pytest exit $rc)"
  echo "sglang $release $what ($name): $verdict, $p passed, $f failed in $((SECONDS - start)) s|$p|$f|$s" \
    > "$logs/$name.sum"
}

if [ "${1:-}" = "--sglang" ]; then
  [ $# -ge 2 ] || { echo "usage: $0 --sglang RELEASE [pytest args]" >&2; exit 2; }
  release=$2
  shift 2
  run_part "sglang-$release" "$release" "$@"
elif [ $# -gt 0 ]; then
  run_part "suite" "$venv_release" "$@"
else
  # Every overlay first: the upstream-patch test applies the patch to each release.
  for release in $("$py" -m hicache_async_ack_lab.releases tested); do
    [ "$release" = "$venv_release" ] || "$py" -m hicache_async_ack_lab.releases overlay "$release" >/dev/null
  done
  older=()
  for release in $("$py" -m hicache_async_ack_lab.releases tested); do
    [ "$release" = "$venv_release" ] || older+=("$release")
  done
  # The oldest release runs the whole subset (its TP=2/TP=4 gloo ranks too); the ones
  # between run the guard, the real class and plugin loading (`--sglang R` runs all of
  # it). The newest of them runs after test/e2e, in its stream: both streams end close.
  oldest=${older[0]:-}
  after_e2e=""
  [ ${#older[@]} -lt 2 ] || after_e2e=${older[-1]}
  # Its own process group: stopped with everything it started if this script stops.
  QUIET=1 setsid bash -c "$(declare -f count run_part); $(declare -p py venv_release logs SUBSET SUBSET_UNIT);
    run_part e2e $venv_release test/e2e
    [ -z '$after_e2e' ] || run_part sglang-$after_e2e $after_e2e \"\${SUBSET_UNIT[@]}\"" &
  e2e_pid=$!
  echo "test.sh: test/e2e runs beside the rest (its log follows when it ends)"
  run_part "suite" "$venv_release" test --ignore=test/e2e
  for release in "${older[@]}"; do
    if [ "$release" = "$oldest" ]; then
      run_part "sglang-$release" "$release"
    elif [ "$release" != "$after_e2e" ]; then
      run_part "sglang-$release" "$release" "${SUBSET_UNIT[@]}"
    fi
  done
  wait "$e2e_pid" || true
  e2e_pid=""
  echo
  for part in e2e ${after_e2e:+"sglang-$after_e2e"}; do  # the second stream's parts
    cat "$logs/$part.log" 2>/dev/null || echo "test.sh: $part left no log"
    [ -e "$logs/$part.sum" ] || echo "$part: FAILED (no result)|0|1|0" > "$logs/$part.sum"
  done
fi

echo
passed=0
failed=0
skipped=0
parts=0
for sum in "$logs"/*.sum; do
  [ -e "$sum" ] || continue
  IFS='|' read -r line p f s < "$sum"
  echo "test.sh: $line"
  passed=$((passed + p))
  failed=$((failed + f))
  skipped=$((skipped + s))
  parts=$((parts + 1))
done
if [ "$parts" -eq 0 ]; then
  echo "test.sh: no part reported"
  failed=1
fi
echo "tests: $passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
