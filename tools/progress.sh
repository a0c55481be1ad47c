#!/usr/bin/env bash
# tools/progress.sh LABEL COMMAND [ARGS...]
#
# Runs COMMAND with its output in a log, and every 20 s prints one line: LABEL,
# the time so far and the command's latest line of output (pip's "Downloading
# torch ...", ninja's "[12/40] Building CXX object backend/..."), so a long
# install or build is never silent. On failure it prints the log's last 60
# lines and exits with the command's status; the whole log stays in
# ${TMPDIR:-/tmp}.
set -uo pipefail
label=$1
shift
log=$(mktemp "${TMPDIR:-/tmp}/lionbit-progress.XXXXXX")
start=$SECONDS
"$@" >"$log" 2>&1 &
pid=$!
# Stop the command with us (Ctrl-C).
trap 'kill "$pid" 2>/dev/null; exit 130' INT TERM
last=$SECONDS
while kill -0 "$pid" 2>/dev/null; do
  sleep 1
  if ((SECONDS - last >= 20)); then
    last=$SECONDS
    latest=$(tr '\r' '\n' <"$log" | grep -v '^[[:space:]]*$' | tail -n 1 | cut -c1-110)
    printf '%s: %dm%02ds so far%s\n' "$label" $(((SECONDS - start) / 60)) $(((SECONDS - start) % 60)) \
      "${latest:+  | $latest}"
  fi
done
wait "$pid"
rc=$?
if ((rc != 0)); then
  echo "$label: failed (exit $rc) after $((SECONDS - start)) s; the last lines of its output ($log):"
  tail -n 60 "$log"
  exit "$rc"
fi
printf '%s: done in %dm%02ds\n' "$label" $(((SECONDS - start) / 60)) $(((SECONDS - start) % 60))
rm -f "$log"
