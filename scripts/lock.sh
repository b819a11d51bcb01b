#!/usr/bin/env bash
# Re-resolves the test environment into constraints-test.txt: one pinned version of every package that `.[dev]` needs
# (rllog itself excluded), plus the build and bootstrap tools (setuptools, wheel, pip, uv), for Python 3.11 on this
# platform, within the hand-written bounds of constraints.txt (the CPU torch pin). Commit the result; scripts/setup.sh
# installs exactly it.
#   bash scripts/lock.sh                          after changing a dependency: keeps every pin that still fits
#   bash scripts/lock.sh --upgrade                takes every new release
#   bash scripts/lock.sh --upgrade-package wandb  takes one package's new release
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
PY=${PYTHON:-python3}

# A throwaway venv holding only uv, so locking neither needs nor changes .venv.
make_uv() {
  local dir=$1 pin=()
  [ -f "$LOCK" ] && pin=(-c "$LOCK")
  "$PY" -m venv "$dir"
  "$dir/bin/python" -m pip install -q "${pin[@]}" uv
}

lock() {
  local sources
  work=$(mktemp -d)  # global: the EXIT trap reads it
  trap 'rm -rf "$work"' EXIT
  make_uv "$work/venv"
  mapfile -t sources < <(uv_args_from_pip_config)
  uv_env_from_pip_config
  "$PY" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"]))' \
    > "$work/tools.txt"
  printf 'pip\nuv\n' >> "$work/tools.txt"
  # The current lock seeds the resolution (uv keeps the pins of an existing output file unless told to upgrade), less
  # the packages constraints.txt pins by hand: a seeded `torch==2.13.0` would take PyPI's CUDA build over the CPU one.
  if [ -f "$LOCK" ]; then
    grep -v -i -E "^($(sed -n 's/^\([A-Za-z0-9._-]*\)==.*/\1/p' constraints.txt | paste -sd'|'))==" "$LOCK" > "$work/lock.txt"
  fi
  "$work/venv/bin/uv" pip compile -q --python-version 3.11 --index-strategy unsafe-best-match "${sources[@]}" \
    --custom-compile-command "bash scripts/lock.sh" -c constraints.txt pyproject.toml --extra dev "$work/tools.txt" \
    -o "$work/lock.txt" "$@"
  # A local label (torch 2.13.0+cpu, from pip's find-links) is dropped: `==2.13.0` still takes the CPU wheel where
  # find-links offers it, and stays installable from PyPI where it doesn't.
  sed -e 's/^\([A-Za-z0-9._-]*==[^+ ]*\)+[A-Za-z0-9.]*/\1/' -e "s|$work/tools.txt|build and bootstrap tools|" \
    "$work/lock.txt" > "$LOCK"
  echo "wrote $LOCK: $(grep -c '^[A-Za-z0-9._-]*==' "$LOCK") pins" >&2
}

lock "$@"
