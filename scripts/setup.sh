#!/usr/bin/env bash
# Create or reuse the project's venv outside the clone (~11 GB with SGLang's CUDA
# wheels) and install this checkout into it: the plugin (pyproject.toml) and the
# lab with its test extra (lab/pyproject.toml), both editable. Idempotent: with
# everything present it only checks stamps (well under a second).
#
# The venv directory is keyed by the Python version and the heavy pins (sglang,
# torch); a stamp inside it is keyed by the whole test extra, so changing a light
# dependency (ruff, mypy, ...) re-runs a quick pip install instead of a fresh venv.
# Any failed install stops here with its output: nothing half-installed passes.
# Prints progress on stderr and the venv path on stdout.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${PYTHON:-python3}
read -r pyver heavy_key deps_key < <("$py" - "$root/lab/pyproject.toml" <<'PY'
import hashlib, re, sys
text = open(sys.argv[1]).read()
block = re.search(r"\[project\.optional-dependencies\](.*?)\n\[", text, re.S).group(1)
heavy = sorted(re.findall(r'"((?:sglang|torch)\b[^"]*)"', block))
digest = lambda s: hashlib.sha256(s.encode()).hexdigest()[:12]
print(f"{sys.version_info[0]}.{sys.version_info[1]}", digest("\n".join(heavy)), digest(block))
PY
)
venv=${HICACHE_ASYNC_ACK_VENV:-$HOME/.cache/hicache-async-ack/venv-py$pyver-$heavy_key}
stamp="$venv/.deps-$deps_key"
pip_q() { "$venv/bin/pip" install -q --disable-pip-version-check "$@"; }
# Mooncake (the L3 store of the Mooncake e2e tests and bench): its native libraries
# load libibverbs even for TCP. Debian packages, installed only when missing.
mooncake_debs=(libibverbs1 libnl-3-200 libnl-route-3-200)
missing_debs=()
for deb in "${mooncake_debs[@]}"; do
  dpkg-query -W -f='${Status}' "$deb" 2>/dev/null | grep -q "install ok installed" \
    || missing_debs+=("$deb")
done
if [ ${#missing_debs[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing ${missing_debs[*]} (Mooncake's native libraries)" >&2
    if ! log=$( (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends "${missing_debs[@]}") 2>&1); then
      echo "$log" >&2
      echo "setup: apt-get install ${missing_debs[*]} failed (above)" >&2
      exit 1
    fi
  else
    echo "setup: warning: ${missing_debs[*]} missing (needs root and apt-get):" \
      "the Mooncake tests will fail to load its libraries" >&2
  fi
fi
# Prometheus 2.42 and promtool (Debian's `prometheus`): the alert-rule tests and the
# real-Prometheus end-to-end test. Installed only when missing; its service is never
# started (a policy-rc.d that denies starts, only for the install, where none exists).
if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing prometheus (promtool, for the monitoring tests)" >&2
    own_policy=
    if [ ! -e /usr/sbin/policy-rc.d ]; then
      printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
      own_policy=1
    fi
    rc=0
    log=$( (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends prometheus) 2>&1) || rc=$?
    [ -n "$own_policy" ] && rm -f /usr/sbin/policy-rc.d
    if [ "$rc" != 0 ]; then
      echo "$log" >&2
      echo "setup: apt-get install prometheus failed (above)" >&2
      exit 1
    fi
  else
    echo "setup: warning: prometheus/promtool missing (needs root and apt-get):" \
      "the monitoring tests will fail" >&2
  fi
fi
if [ ! -x "$venv/bin/python" ]; then
  echo "setup: creating $venv" >&2
  mkdir -p "$(dirname "$venv")"
  "$py" -m venv "$venv"
fi
if [ ! -f "$stamp" ]; then
  echo "setup: installing the test extra (first time with SGLang: several minutes)" >&2
  if ! log=$(pip_q -e "$root" -e "$root/lab[test]" 2>&1); then
    echo "$log" >&2
    echo "setup: pip install failed (above); nothing was stamped" >&2
    exit 1
  fi
  "$venv/bin/python" -c "import sglang, pytest, ruff, mypy, matplotlib, hypothesis, numpy, tqdm"
  rm -f "$venv"/.deps-* && touch "$stamp"
fi
# Point the editable installs (and so the sglang.srt.plugins entry point) at this
# checkout; CI clones afresh each run.
current=$("$venv/bin/python" - <<'PY' 2>/dev/null || true
import importlib.util, os
where = []
for name in ("hicache_async_ack", "hicache_async_ack_lab"):
    spec = importlib.util.find_spec(name)
    where.append(os.path.dirname(os.path.dirname(spec.origin)) if spec else "")
print(" ".join(where))
PY
)
if [ "$current" != "$root/python $root/lab/python" ]; then
  echo "setup: installing this checkout ($root) into the venv" >&2
  if ! log=$(pip_q --no-deps --no-build-isolation -e "$root" -e "$root/lab" 2>&1); then
    echo "$log" >&2
    echo "setup: installing the checkout failed (above)" >&2
    exit 1
  fi
fi
"$venv/bin/python" -c "import hicache_async_ack, hicache_async_ack_lab" \
  || { echo "setup: install failed" >&2; exit 1; }
# The tiny model cpu-server and the end-to-end tests serve (built offline once, in
# ~/.cache/hicache-async-ack; a no-op when present).
"$venv/bin/python" -c "from hicache_async_ack_lab.cpu_server.model import ensure_model as m; m()" \
  || { echo "setup: building the tiny model failed" >&2; exit 1; }
echo "$venv"
