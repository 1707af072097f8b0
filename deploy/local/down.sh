#!/usr/bin/env bash
# Stops the local cluster deploy/local/up.sh started and removes what it made on the host: its
# pods' containers and network namespaces, every process by its pid file, the mounts under its
# folders, its cgroups, the pod bridge, the route and the iptables rules (kube-proxy's chains with
# kube-proxy --cleanup, the FORWARD accepts by their comment). The images stay (containerd's
# store in .tools/cluster, a cache), and so do the certificates; etcd's data and the kubelet's
# folder go. Safe to run when nothing runs.
set -uo pipefail
cd "$(dirname "$0")/../.."
source deploy/local/versions.sh

S=$PWD/.tools/cluster
RUN=/run/kvxfer-k8s
BIN=$PWD/$K8S_BIN
KUBECTL=("$BIN/kubectl" --kubeconfig "$S/admin.kubeconfig" --request-timeout 10s)
say() { echo "kvxfer cluster (down): $*"; }
alive() { [ -f "$S/run/$1.pid" ] && kill -0 "$(cat "$S/run/$1.pid")" 2>/dev/null; }
stop() { # name: TERM, up to 15 s, then KILL
  local f=$S/run/$1.pid pid
  [ -f "$f" ] || return 0
  pid=$(cat "$f")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 1 75); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
  fi
  rm -f "$f"
}

# 1. Pods first, while the kubelet can still tear their sandboxes down (CNI DEL).
if alive kube-apiserver && alive kubelet; then
  "${KUBECTL[@]}" delete pods --all --all-namespaces --grace-period 0 --force --wait=false >/dev/null 2>&1
  for _ in $(seq 1 60); do
    n=$("${KUBECTL[@]}" get pods --all-namespaces --no-headers 2>/dev/null | wc -l)
    [ "$n" = 0 ] && break
    sleep 0.5
  done
fi
# 2. Whatever containerd still runs (sandboxes the kubelet had not collected yet).
CTR=(ctr --address "$RUN/containerd.sock" --namespace k8s.io)
if alive containerd; then
  stop kubelet
  for t in $("${CTR[@]}" tasks ls -q 2>/dev/null); do "${CTR[@]}" tasks kill -s KILL "$t" >/dev/null 2>&1; done
  for _ in $(seq 1 50); do
    [ -z "$("${CTR[@]}" tasks ls -q 2>/dev/null)" ] && break
    sleep 0.2
  done
  for t in $("${CTR[@]}" tasks ls -q 2>/dev/null); do "${CTR[@]}" tasks delete -f "$t" >/dev/null 2>&1; done
  for c in $("${CTR[@]}" containers ls -q 2>/dev/null); do "${CTR[@]}" containers delete "$c" >/dev/null 2>&1; done
fi
# 3. The processes, by their pid files.
for p in coredns kube-proxy kubelet kube-scheduler kube-controller-manager kube-apiserver containerd etcd; do stop "$p"; done
# containerd's shims outlive it; ours name our socket.
for pid in $(pgrep -f "containerd-shim-runc-v2 -namespace k8s.io .*-address $RUN/containerd.sock" 2>/dev/null); do
  kill -KILL "$pid" 2>/dev/null
done
# 4. Network: kube-proxy's rules, the pods' namespaces, the bridge, the route, the FORWARD accepts.
[ -x "$BIN/kube-proxy" ] && "$BIN/kube-proxy" --cleanup >/dev/null 2>&1
# The kubelet's own chains (KUBE-FIREWALL, which INPUT and OUTPUT jump to; the canaries; the hint),
# in both families; kube-proxy --cleanup leaves them.
for ipt in iptables ip6tables; do
  command -v "$ipt" >/dev/null || continue
  for base in INPUT OUTPUT; do
    while "$ipt" -t filter -D "$base" -j KUBE-FIREWALL 2>/dev/null; do :; done
  done
  for table in filter nat mangle; do
    for chain in KUBE-FIREWALL KUBE-KUBELET-CANARY KUBE-IPTABLES-HINT; do
      "$ipt" -t "$table" -F "$chain" 2>/dev/null && "$ipt" -t "$table" -X "$chain" 2>/dev/null
    done
  done
done
for ns in "$RUN"/containerd/netns/*; do
  [ -e "$ns" ] || continue
  umount "$ns" 2>/dev/null; rm -f "$ns"
done
ip route del "$SERVICE_CIDR" dev "$POD_BRIDGE" 2>/dev/null
ip link show "$POD_BRIDGE" >/dev/null 2>&1 && ip link delete "$POD_BRIDGE"
for dir in -i -o; do
  while iptables -D FORWARD "$dir" "$POD_BRIDGE" -j ACCEPT -m comment --comment "$NAME_PREFIX" 2>/dev/null; do :; done
done
# 5. Mounts left under our folders (deepest first), our cgroups, the state.
for m in $(awk -v a="$S/" -v b="$RUN/" 'index($2, a) == 1 || index($2, b) == 1 {print $2}' /proc/self/mounts | sort -r); do
  umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null
done
for c in /sys/fs/cgroup/*/kubepods; do
  [ -d "$c" ] && find "$c" -depth -type d -exec rmdir {} + 2>/dev/null
done
rm -rf "$S/etcd" "$S/kubelet" "$S/run" "$S/cni-ipam" "$S/pod-logs" "$RUN"
say "stopped"
