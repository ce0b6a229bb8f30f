#!/usr/bin/env bash
# Create or reuse the project's venv outside the clone (it is ~11 GB with SGLang's
# CUDA wheels) and install this checkout into it with the test extra. Idempotent:
# with everything present it only re-points the editable install (seconds).
# Prints nothing but progress on stderr; the venv path on stdout.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${PYTHON:-python3}
pyver=$("$py" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
# The venv is keyed by the Python version and the dependency set in pyproject.toml.
deps_key=$("$py" - "$root/pyproject.toml" <<'PY'
import hashlib, re, sys
text = open(sys.argv[1]).read()
block = re.search(r"\[project\.optional-dependencies\](.*?)\n\[", text, re.S).group(1)
print(hashlib.sha256(block.encode()).hexdigest()[:12])
PY
)
venv=${HICACHE_ASYNC_ACK_VENV:-$HOME/.cache/hicache-async-ack/venv-py$pyver-$deps_key}
stamp="$venv/.deps-installed"
if [ ! -x "$venv/bin/python" ]; then
  echo "setup: creating $venv" >&2
  mkdir -p "$(dirname "$venv")"
  "$py" -m venv "$venv"
fi
if [ ! -f "$stamp" ]; then
  echo "setup: installing sglang==0.5.23 and the test extra (first time: several minutes)" >&2
  "$venv/bin/pip" install -q --disable-pip-version-check -e "$root[test]" 2>&1 \
    | grep -v "^WARNING: Location" >&2 || true
  "$venv/bin/python" -c "import sglang, pytest, ruff, matplotlib, hypothesis" \
    && touch "$stamp"
fi
# Point the editable install (and so the sglang.srt.plugins entry point) at this
# checkout; CI clones afresh each run.
current=$("$venv/bin/python" - <<'PY' 2>/dev/null || true
import importlib.util, os
spec = importlib.util.find_spec("hicache_async_ack")
print(os.path.dirname(os.path.dirname(os.path.dirname(spec.origin))) if spec else "")
PY
)
if [ "$current" != "$root" ]; then
  echo "setup: installing this checkout ($root) into the venv" >&2
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps --no-build-isolation \
    -e "$root" 2>&1 | grep -v "^WARNING: Location" >&2 || true
fi
"$venv/bin/python" -c "import hicache_async_ack" || { echo "setup: install failed" >&2; exit 1; }
echo "$venv"
