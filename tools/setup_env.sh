#!/usr/bin/env bash
# Sets up everything `make test` and `make demo` need on a fresh Debian 12
# machine, and is quick (a few checks) when that is already done:
#   1. Debian packages (compiler, CMake, GoogleTest, Python headers, venv,
#      clang-format, ccache): installed when running as root (CI); otherwise, when
#      some are missing, it stops and prints the apt-get command to run as
#      root (tools/apt_need.sh; never sudo);
#   2. a virtual environment OUTSIDE the clone ($LIONBIT_VENV), so a fresh
#      clone reuses it and its multi-GB torch;
#   3. torch ($TORCH_SPEC) and the Python tools in it.
set -euo pipefail

VENV=${LIONBIT_VENV:?LIONBIT_VENV must be set}
TORCH_SPEC=${TORCH_SPEC:?TORCH_SPEC must be set}
PYTHON=${PYTHON:-python3}
here=$(cd "$(dirname "$0")" && pwd)

# --- 1. Debian packages --------------------------------------------------
"$here/apt_need.sh" setup g++ cmake ninja-build make git libgtest-dev libgmock-dev python3-dev python3-venv \
  clang-format ccache

# --- 2. the virtual environment -----------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating the virtual environment $VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi

# --- 3. Python packages (a stamp records what was installed) -------------
want="$(cat "$here/requirements-dev.txt")
$TORCH_SPEC"
stamp="$VENV/.lionbit-setup"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setup: installing $TORCH_SPEC and the test tools into $VENV (the first time: torch and"
  echo "       its CUDA libraries, about 6 GB installed, a few minutes; a line every 20 s says how far it is)"
  "$here/progress.sh" "setup: pip" "$VENV/bin/python" -m pip install --progress-bar off --disable-pip-version-check \
    "$TORCH_SPEC" -r "$here/requirements-dev.txt"
  printf '%s' "$want" > "$stamp"
fi
