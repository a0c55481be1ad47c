#!/usr/bin/env bash
# Runs the torch-free kernel test binaries (a plain RelWithDebInfo build)
# under valgrind memcheck: any invalid read/write, use of uninitialised
# memory or leak fails the run.
#   tools/valgrind_tests.sh BUILD_DIR [gtest filter]
# The default filter leaves out the 1M-element cases (100k ones stay) (hundreds of times
# slower under valgrind, no different code path); LIONBIT_VALGRIND_FILTER='*'
# runs everything. Valgrind cannot run AVX-512 code: the kernels' run-time
# check sees no AVX-512 in valgrind's CPUID and those cases are skipped
# (ASan in `make test-sanitize` covers them natively).
set -u
dir=$1
filter=${2:-${LIONBIT_VALGRIND_FILTER:--*n1000000*:*n1000003*}}
fail=0
total_start=$(date +%s)
for t in "$dir"/tests/cpp/test_*; do
  [ -x "$t" ] && [ -f "$t" ] || continue
  name=$(basename "$t")
  start=$(date +%s)
  log=$(mktemp)
  LIONBIT_FUZZ_ITERS=${LIONBIT_FUZZ_ITERS:-1} valgrind --tool=memcheck --error-exitcode=99 \
    --leak-check=full --errors-for-leak-kinds=definite,indirect --track-origins=yes -q \
    "$t" --gtest_filter="$filter" --gtest_brief=1 > "$log" 2>&1
  rc=$?
  ran=$(grep -oE '\[==========\] [0-9]+ tests?' "$log" | grep -oE '[0-9]+' | head -1)
  errs=$(grep -cE '^==[0-9]+== ' "$log")
  echo "valgrind $name: exit $rc, ${ran:-0} tests, $errs valgrind lines, $(( $(date +%s) - start )) s"
  if [ "$rc" != 0 ]; then
    fail=1
    tail -60 "$log"
  fi
  rm -f "$log"
done
echo "valgrind: $([ $fail = 0 ] && echo clean || echo FAILED) in $(( $(date +%s) - total_start )) s"
exit $fail
