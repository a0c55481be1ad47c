#!/usr/bin/env bash
# Repeat a multi-process launch to catch rare hangs or crashes at start-up or
# teardown. On a run that outlives LIMIT seconds, prints every worker's thread
# backtraces (gdb) and stops; on a failed run, prints its log and stops.
#   tools/launch_loop.sh RUNS LIMIT torchrun --standalone --nproc-per-node 2 script.py args...
set -u
runs=$1 limit=$2
shift 2
log=$(mktemp)
for i in $(seq 1 "$runs"); do
  env -u LOCAL_WORLD_SIZE "$@" > "$log" 2>&1 &
  pid=$!
  for _ in $(seq 1 $((limit * 2))); do kill -0 $pid 2>/dev/null || break; sleep 0.5; done
  if kill -0 $pid 2>/dev/null; then
    echo "run $i: still running after ${limit}s; backtraces of its workers:"
    for w in $(pgrep -P "$(pgrep -P $pid | head -1)" 2>/dev/null) $(pgrep -P $pid); do
      echo "== pid $w: $(tr '\0' ' ' < /proc/$w/cmdline | cut -c1-100)"
      timeout 60 gdb -p "$w" -batch -ex "thread apply all bt 16" 2>/dev/null | grep -E "^Thread|^#" | c++filt
    done
    pkill -9 -P $pid; kill -9 $pid; wait $pid 2>/dev/null
    exit 1
  fi
  if ! wait $pid; then
    echo "run $i failed:"; cat "$log"; exit 1
  fi
done
echo "$runs runs, no hang and no failure"
