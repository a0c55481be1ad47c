#!/usr/bin/env bash
# Lint: ruff over the Python files (rules in pyproject.toml's [tool.ruff]) and,
# with --cpp (or LIONBIT_LINT_CPP=1), the C++ format check: clang-format
# --dry-run --Werror with .clang-format over every tracked C++ file.
#   tools/lint.sh            ruff; plus the C++ check when LIONBIT_LINT_CPP=1
#   tools/lint.sh --cpp      the C++ check alone
# ruff comes from the venv (tools/requirements-dev.txt pins it), clang-format
# from Debian (tools/setup_env.sh installs both).
set -euo pipefail
cd "$(dirname "$0")/.."

python=1
cpp=${LIONBIT_LINT_CPP:-0}
case "${1:-}" in
  "") ;;
  --cpp) python=0; cpp=1 ;;
  *) echo "usage: tools/lint.sh [--cpp]" >&2; exit 2 ;;
esac

status=0
if [ "$python" = 1 ]; then
  ruff=${LIONBIT_VENV:-$HOME/.cache/lionbit/venv}/bin/ruff
  [ -x "$ruff" ] || ruff=$(command -v ruff) || {
    echo "lint: no ruff (make setup installs it into the venv)" >&2
    exit 1
  }
  echo "lint: $("$ruff" --version) check"
  "$ruff" check . || status=1
fi

if [ "$cpp" = 1 ]; then
  command -v clang-format >/dev/null || {
    echo "lint: no clang-format (as root: apt-get install -y clang-format)" >&2
    exit 1
  }
  # The format depends on the version: .clang-format is tuned on Debian 12's 14.
  version=$(clang-format --version)
  case "$version" in
    *" version 14."*) ;;
    *) echo "lint: warning: $version; .clang-format was tuned with clang-format 14 (Debian 12)" >&2 ;;
  esac
  mapfile -d '' files < <(git ls-files -z '*.cpp' '*.hpp' '*.h' '*.cu' '*.cuh')
  echo "lint: clang-format --dry-run --Werror over ${#files[@]} C++ files"
  clang-format --style=file --dry-run --Werror "${files[@]}" || {
    echo "lint: C++ files need formatting: make format-cpp (clang-format -i on them)" >&2
    status=1
  }
fi
exit $status
