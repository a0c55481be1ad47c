#!/usr/bin/env bash
# Set-up for `make bench` (after tools/setup_env.sh): Google Benchmark, the Debian tools the
# emulated network needs (iproute2 for ip/tc, iperf3 for the rate check,
# ethtool to turn segment offloads off) and matplotlib in the venv. Quick
# when already done.
set -euo pipefail
VENV=${LIONBIT_VENV:?LIONBIT_VENV must be set}
here=$(cd "$(dirname "$0")" && pwd)

need=()
for pkg in iproute2 iperf3 ethtool libbenchmark-dev; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  if [ -z "$sudo" ] || sudo -n true 2>/dev/null; then
    echo "setup-bench: installing Debian packages: ${need[*]}"
    $sudo apt-get update -qq
    # iperf3's postinst asks whether to start a daemon: answer no.
    echo "iperf3 iperf3/start_daemon boolean false" | $sudo debconf-set-selections 2>/dev/null || true
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
  else
    echo "setup-bench: no root (and no password-less sudo): not installing ${need[*]} (the benchmark"
    echo "setup-bench: falls back to loopback); to install them, as root run"
    echo "    apt-get update && apt-get install -y ${need[*]}"
  fi
fi

stamp="$VENV/.lionbit-setup-bench"
want="$(cat "$here/requirements-bench.txt")"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setup-bench: installing $(echo $want) into $VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r "$here/requirements-bench.txt"
  printf '%s' "$want" > "$stamp"
fi
