#!/usr/bin/env bash
# tools/setup_env.sh [demo]: sets up what `make test` (no argument) or
# `make demo` (demo) needs on a fresh Debian 12 machine, and is quick (a few
# checks) when that is already done:
#   1. Debian packages: the compiler, CMake, Python headers, venv, ccache; for
#      the tests also GoogleTest and clang-format. Installed when running as
#      root (CI); otherwise, when some are missing, it stops and prints the
#      apt-get command to run as root (tools/apt_need.sh; never sudo);
#   2. a virtual environment OUTSIDE the clone ($LIONBIT_VENV), so a fresh
#      clone reuses it and its multi-GB torch;
#   3. torch ($TORCH_SPEC) and tools/requirements-demo.txt; for the tests also
#      tools/requirements-dev.txt. A first `make demo` installs only the first,
#      and `make test` adds the rest when it first asks.
# Python packages go in with uv (from PyPI, into the venv): it downloads in
# parallel, links files from its cache and compiles modules in parallel, where
# pip unpacks torch's 6 GB one file at a time; pip if uv cannot be installed.
set -euo pipefail

VENV=${LIONBIT_VENV:?LIONBIT_VENV must be set}
TORCH_SPEC=${TORCH_SPEC:?TORCH_SPEC must be set}
PYTHON=${PYTHON:-python3}
here=$(cd "$(dirname "$0")" && pwd)
tier=${1:-test}
case "$tier" in demo | test) ;; *) echo "usage: tools/setup_env.sh [demo]" >&2; exit 2 ;; esac

# --- 1. Debian packages --------------------------------------------------
debs=(g++ cmake ninja-build make git python3-dev python3-venv ccache)
[ "$tier" = test ] && debs+=(libgtest-dev libgmock-dev clang-format)
"$here/apt_need.sh" setup "${debs[@]}"

# --- 2. the virtual environment -----------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating the virtual environment $VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PYTHON" -m venv "$VENV"
fi

# --- 3. Python packages (a stamp records what was installed) -------------
# The stamp holds the demo's list, then the tests' when they were added: the
# tests' set-up includes the demo's.
demo="$TORCH_SPEC
$(cat "$here/requirements-demo.txt")"
full="$demo
$(cat "$here/requirements-dev.txt")"
want=$demo
[ "$tier" = test ] && want=$full
stamp="$VENV/.lionbit-setup"
have=$(cat "$stamp" 2>/dev/null || true)
if [ "$have" = "$want" ] || [ "$have" = "$full" ]; then
  exit 0
fi

reqs=(-r "$here/requirements-demo.txt")
what="torch and the build tools"
if [ "$tier" = test ]; then
  reqs+=(-r "$here/requirements-dev.txt")
  what="torch, the build tools and the test tools"
fi
if [ "$have" = "$demo" ]; then
  echo "setup: adding the test tools to $VENV"
else
  echo "setup: installing $what into $VENV (the first time: torch and its CUDA"
  echo "       libraries, about 6 GB, a minute or two; a line every 20 s says how far it is)"
fi
if "$VENV/bin/python" -m uv --version >/dev/null 2>&1 ||
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check uv >/dev/null 2>&1; then
  # --compile-bytecode: as pip does; with PYTHONDONTWRITEBYTECODE set, a module
  # never compiled would be compiled again at every import (import torch: 9 s, not 4).
  "$here/progress.sh" "setup: uv" "$VENV/bin/python" -m uv pip install --compile-bytecode \
    --python "$VENV/bin/python" "$TORCH_SPEC" "${reqs[@]}"
else
  echo "setup: uv could not be installed; pip instead (slower)"
  "$here/progress.sh" "setup: pip" "$VENV/bin/python" -m pip install --progress-bar off --disable-pip-version-check \
    "$TORCH_SPEC" "${reqs[@]}"
fi
printf '%s' "$want" > "$stamp"
