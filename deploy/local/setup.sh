#!/usr/bin/env bash
# Installs what the images and the local cluster need from Debian 12's apt (needs root), if it is
# missing: Docker 20.10, containerd 1.6, runc, etcd 3.4, the CNI plugins, iptables, conntrack and
# debootstrap. Nothing is started: while apt installs, a policy-rc.d refuses every service start
# (docker.io and containerd would start their system daemons otherwise); kvxfer starts its own
# (deploy/local/docker.sh, deploy/local/up.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
source deploy/local/versions.sh

have() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
need=()
for p in $CLUSTER_APT_PACKAGES; do have "$p" || need+=("$p"); done
[ ${#need[@]} -eq 0 ] && exit 0
[ "$(id -u)" = 0 ] || { echo "kvxfer setup (cluster): missing ${need[*]}: apt-get install them as root" >&2; exit 1; }
echo "kvxfer setup (cluster): installing ${need[*]}"
policy=/usr/sbin/policy-rc.d
made=""
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\n# kvxfer deploy/local/setup.sh: no service starts while it installs\nexit 101\n' >"$policy"
  chmod 755 "$policy"
  made=yes
fi
trap '[ -n "$made" ] && rm -f "$policy"' EXIT
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
