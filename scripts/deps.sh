#!/bin/sh
# Installs the Debian packages the build and the suite need, only when one is
# missing, so `make test` works on a fresh machine and costs nothing after.
set -e
PKGS="build-essential pkg-config libgloo-dev libuv1-dev libprotobuf-c-dev protobuf-c-compiler libcriterion-dev python3 python3-torch python3-numpy"
missing=""
for p in $PKGS; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
[ -z "$missing" ] && exit 0
echo "deps: installing$missing"
if [ "$(id -u)" != 0 ]; then
  echo "deps: not root; run: sudo apt-get update && sudo apt-get install -y$missing" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends $missing
