#!/usr/bin/env bash
# Makes sure the Debian packages named are installed, never through sudo:
#   - all there: quick (one dpkg-query per package), nothing printed;
#   - some missing, running as root (CI, a fresh machine): installs them;
#   - some missing, not root: prints the exact command to run as root, and fails.
# usage: tools/apt_need.sh WHO PACKAGE...   (WHO prefixes the messages)
set -euo pipefail
who=${1:?usage: tools/apt_need.sh WHO PACKAGE...}
shift

need=()
for pkg in "$@"; do
  [ "$(dpkg-query -W -f='${db:Status-Status}' "$pkg" 2>/dev/null)" = installed ] || need+=("$pkg")
done
[ ${#need[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -ne 0 ]; then
  {
    echo "$who: missing Debian packages: ${need[*]}"
    echo "$who: installing them needs root; as root, run"
    echo "    apt-get update && apt-get install -y ${need[*]}"
    echo "$who: then run make again"
  } >&2
  exit 1
fi
echo "$who: installing Debian packages: ${need[*]}"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
