#!/usr/bin/env bash
# tools/build.sh [tests]: builds lionbit and installs it into $LIONBIT_VENV
# (pip install --no-build-isolation: against the venv's torch), printing a
# line every 20 s with the build's progress (tools/progress.sh).
#
# The extension's CUDA path (nvcc kernels, the NCCL transport):
#   LIONBIT_CUDA=AUTO|ON|OFF in the environment decides, when set;
#   else `tools/build.sh tests` (make test, test-python, test-aten, test-gpu)
#     builds it wherever nvcc is, GPU or not, so CI keeps compiling it;
#   else (make build, make demo) it is built only where a GPU is visible
#     (nvidia-smi -L): a first run on a CPU machine does not wait for CUDA
#     kernels it cannot run.
# Each choice has its own incremental build folder (build/<wheel tag>,
# build/<wheel tag>-cpu), so switching between them costs a reinstall, not a
# rebuild.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
py=${LIONBIT_VENV:?LIONBIT_VENV must be set}/bin/python

cuda=${LIONBIT_CUDA:-}
if [ -z "$cuda" ]; then
  if [ "${1:-}" = tests ] || nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    cuda=AUTO
  else
    cuda=OFF
  fi
fi
# The tests' module lionbit._test_hooks is built for the tests alone.
hooks=OFF
[ "${1:-}" = tests ] && hooks=ON
dir='build/{wheel_tag}'
[ "$cuda" = OFF ] && dir='build/{wheel_tag}-cpu'
why=""
[ "$cuda" = OFF ] && [ -z "${LIONBIT_CUDA:-}" ] && why=" (no GPU here: CUDA kernels skipped; LIONBIT_CUDA=AUTO builds them)"
echo "build: lionbit into $LIONBIT_VENV, CUDA $cuda$why"
"$here/progress.sh" "build" "$py" -m pip install -v --no-build-isolation --no-deps --disable-pip-version-check \
  -C "cmake.define.LIONBIT_CUDA=$cuda" -C "cmake.define.LIONBIT_TEST_HOOKS=$hooks" -C "build-dir=$dir" .
