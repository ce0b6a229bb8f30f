#!/usr/bin/env bash
# Set up what is missing, then run the test suite against the tested SGLang releases.
#
#   scripts/test.sh                    everything CI needs (what .ci/run calls): the full
#                                      suite on the venv's SGLang (the newest tested), then
#                                      the per-release subset on every other tested release
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
SUBSET=(test/unit/test_upstream.py test/unit/test_sglang_cache.py test/unit/test_plugin_loading.py
  test/multirank/test_tp_groups.py)

venv_release=$("$py" -c 'from hicache_async_ack.guard import installed_version as v; print(v())')
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
summary=()
passed=0
failed=0
skipped=0

count() {  # count WORD LOG: N from pytest's closing line ("3 passed, 1 skipped in 2.0s")
  local line
  line=$(grep -E '^=+ .* in [0-9.]+s' "$2" | tail -1 || true)
  echo "$line" | grep -oE "[0-9]+ $1" | grep -oE '^[0-9]+' || echo 0
}

run_part() {  # run_part RELEASE [pytest args...]
  local release=$1 what="full suite" overlay="" log rc=0 start=$SECONDS
  shift
  local -a tests=(test)
  log="$logs/$release.log"
  if [ "$release" != "$venv_release" ]; then
    what="release subset"
    tests=("${SUBSET[@]}")
    if ! overlay=$("$py" -m hicache_async_ack_lab.releases overlay "$release"); then
      summary+=("sglang $release $what: FAILED (no overlay) in $((SECONDS - start)) s")
      failed=$((failed + 1))
      return
    fi
  fi
  echo "test.sh: sglang $release, $what${overlay:+ (overlay $overlay)}"
  PYTHONPATH=$overlay "$py" -m pytest "${tests[@]}" "$@" 2>&1 | tee "$log" || rc=$?
  local p f e s
  p=$(count passed "$log")
  f=$(count failed "$log")
  e=$(count error "$log")
  s=$(count skipped "$log")
  passed=$((passed + p))
  skipped=$((skipped + s))
  failed=$((failed + f + e))
  if [ "$rc" -ne 0 ] && [ $((f + e)) -eq 0 ]; then
    failed=$((failed + 1))  # pytest itself failed (collection, no tests, ...)
  fi
  local verdict="passed"
  [ "$rc" -eq 0 ] || verdict="FAILED (pytest exit $rc)"
  summary+=("sglang $release $what: $verdict, $p passed, $((f + e)) failed in $((SECONDS - start)) s")
}

if [ "${1:-}" = "--sglang" ]; then
  [ $# -ge 2 ] || { echo "usage: $0 --sglang RELEASE [pytest args]" >&2; exit 2; }
  release=$2
  shift 2
  run_part "$release" "$@"
elif [ $# -gt 0 ]; then
  run_part "$venv_release" "$@"
else
  # Every overlay first: the upstream-patch test applies the patch to each release.
  for release in $("$py" -m hicache_async_ack_lab.releases tested); do
    [ "$release" = "$venv_release" ] || "$py" -m hicache_async_ack_lab.releases overlay "$release" >/dev/null
  done
  run_part "$venv_release"
  for release in $("$py" -m hicache_async_ack_lab.releases tested); do
    [ "$release" = "$venv_release" ] || run_part "$release"
  done
fi

echo
for line in "${summary[@]}"; do
  echo "test.sh: $line"
done
echo "tests: $passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
