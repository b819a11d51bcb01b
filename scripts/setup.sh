#!/usr/bin/env bash
# Creates and fills .venv (idempotent): rllog in editable mode with every tracker, TRL and the test and lint tools, every
# package at the version pinned in constraints-test.txt (refreshed by scripts/lock.sh) and torch at the CPU pin in
# constraints.txt (unpinned, an install pulls a multi-GB CUDA build). Installs with uv (a PyPI package, put into the venv
# by pip), falling back to plain pip where uv cannot be installed. RLLOG_INSTALLER=pip forces the pip path.
# scripts/lock.sh sources this file for the pip-config translation below.
set -euo pipefail

LOCK=constraints-test.txt

# uv does not read pip's configuration, and this machine's pip finds the CPU torch wheel through its configured
# find-links and extra indexes: print pip's sources (and certificate and timeout) as uv options, one per line,
# leaving out local directories that do not exist.
uv_args_from_pip_config() {
  "${PY:-python3}" - <<'EOF'
import ast, os, subprocess, sys
from urllib.parse import urlparse

listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
config: dict[str, list[str]] = {}
for line in listing.splitlines():
    key, sep, value = line.partition("=")
    section, _, name = key.rpartition(".")
    if sep and section in ("global", "install", ":env:"):
        config.setdefault(name, []).extend(ast.literal_eval(value).split())

def present(location: str) -> bool:
    url = urlparse(location)
    if url.scheme in ("http", "https"):
        return True
    return os.path.exists(url.path if url.scheme == "file" else location)

def unique(values: list[str]) -> list[str]:
    return [v for v in dict.fromkeys(values) if present(v)]

for location in unique(config.get("find-links", [])):
    print(f"--find-links={location}")
for location in unique(config.get("index-url", []))[-1:]:
    print(f"--default-index={location}")
for location in unique(config.get("extra-index-url", [])):
    print(f"--extra-index-url={location}")
EOF
}

# Environment for uv mirroring pip's certificate bundle and timeout, as `export` lines (empty when pip sets neither).
uv_env_from_pip_config() {
  local cert timeout
  cert=$("${PY:-python3}" -m pip config get global.cert 2>/dev/null || true)
  cert=${PIP_CERT:-$cert}
  timeout=$("${PY:-python3}" -m pip config get global.timeout 2>/dev/null || true)
  timeout=${PIP_DEFAULT_TIMEOUT:-${PIP_TIMEOUT:-$timeout}}
  if [ -n "$cert" ] && [ -f "$cert" ] && [ -z "${SSL_CERT_FILE:-}" ]; then export SSL_CERT_FILE="$cert"; fi
  if [ -n "$timeout" ] && [ -z "${UV_HTTP_TIMEOUT:-}" ]; then export UV_HTTP_TIMEOUT="$timeout"; fi
}

# Puts the pinned uv into the venv; fails where it cannot (no wheel for this platform, or RLLOG_INSTALLER=pip).
install_uv() {
  [ "${RLLOG_INSTALLER:-auto}" != pip ] && .venv/bin/python -m pip install -qq -c "$LOCK" uv
}

install_with_uv() {
  local sources
  mapfile -t sources < <(uv_args_from_pip_config)
  uv_env_from_pip_config
  # unsafe-best-match is pip's own rule (the best version across all indexes); every version is pinned anyway.
  # --compile-bytecode, as pip does: otherwise every first import in the tests' many processes compiles (measured: a
  # fresh clone's suite ran minutes longer than the same suite in a venv that had been used before).
  .venv/bin/uv pip install -q --compile-bytecode --python .venv/bin/python --index-strategy unsafe-best-match "${sources[@]}" \
    -c constraints.txt -c "$LOCK" --build-constraints "$LOCK" \
    -e ".[dev]" pip --config-setting editable_mode=compat
}

install_with_pip() {
  # PIP_CONSTRAINT (unlike -c) also reaches the isolated environment that builds rllog, pinning setuptools there.
  export PIP_CONSTRAINT="constraints.txt $LOCK"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[dev]" --config-settings editable_mode=compat
}

main() {
  cd "$(dirname "${BASH_SOURCE[0]}")/.."
  PY=${PYTHON:-python3}
  # Tests, demo and lint may start together on a changed tree: one installs, the others wait and then find the stamp.
  if command -v flock > /dev/null; then
    exec 9< scripts/setup.sh
    flock 9
  fi
  local stamp=.venv/.rllog-setup want
  want=$(cat pyproject.toml constraints.txt "$LOCK" | sha256sum | cut -d' ' -f1)
  if [ -x .venv/bin/python ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
  fi
  echo "setting up .venv (first time: under a minute with uv, 2-3 with pip; 2 GB) ..." >&2
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  if install_uv; then
    install_with_uv
  else
    echo "uv unavailable: installing with pip (2-3 minutes) ..." >&2
    install_with_pip
  fi
  echo "$want" > "$stamp"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  main "$@"
fi
