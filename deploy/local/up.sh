#!/usr/bin/env bash
# Brings up a single-node Kubernetes of kvxfer's own on this machine (needs root): the programs
# deploy/local/build.sh built from the Go module proxy, Debian's etcd, containerd (a second
# instance with its CRI plugin, beside the one kvxfer's dockerd runs), runc and CNI bridge plugin,
# CoreDNS, and the images deploy/local/images.sh built, imported into that containerd. Every
# process runs on the host, started here and stopped by deploy/local/down.sh by its pid file;
# everything listens on the pod bridge's address (198.19.160.1) or on loopback.
#
#   deploy/local/up.sh            start it (fails if one runs: down.sh first); prints KUBECONFIG=...
#   deploy/local/up.sh --env      print KUBECONFIG=... for `eval`
#
# What this VM needs, set here (docs/deploy.md says why): containerd's restrict_oom_score_adj
# (root without CAP_SYS_RESOURCE), an iptables FORWARD accept for the pod bridge (in case a dockerd
# set the policy to DROP), the API server's --kubelet-preferred-address-types=InternalIP,Hostname,
# a route to the service range through the pod bridge, and the kubelet's failCgroupV1: false.
set -euo pipefail
cd "$(dirname "$0")/../.."
source deploy/local/versions.sh

ROOT=$PWD
S=$ROOT/.tools/cluster        # state: certificates, configs, etcd, kubelet, logs, pid files
RUN=/run/kvxfer-k8s           # sockets and containerd's state (short paths)
BIN=$ROOT/$K8S_BIN
NODE=kvxfer-node
IP=$POD_GATEWAY
KUBECONFIG_FILE=$S/admin.kubeconfig
fail() { echo "kvxfer cluster (up): $*" >&2; exit 1; }
say() { echo "kvxfer cluster (up): $*"; }

if [ "${1:-}" = "--env" ]; then echo "KUBECONFIG=$KUBECONFIG_FILE"; exit 0; fi
[ "$(id -u)" = 0 ] || fail "needs root (containerd, the kubelet, iptables, a bridge)"
[ -f "$BIN/.kvxfer-build" ] || fail "no Kubernetes programs in $K8S_BIN: run deploy/local/build.sh"
for p in etcd containerd containerd-shim-runc-v2 runc iptables conntrack; do
  command -v "$p" >/dev/null || fail "no $p: run deploy/local/setup.sh (apt-get install $CLUSTER_APT_PACKAGES)"
done
[ -x /usr/lib/cni/bridge ] || fail "no CNI bridge plugin: apt-get install containernetworking-plugins"
for f in "$S"/run/*.pid; do
  [ -f "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null && fail "a cluster runs ($(basename "$f" .pid) pid $(cat "$f")): deploy/local/down.sh first"
done
ip link show "$POD_BRIDGE" >/dev/null 2>&1 && fail "bridge $POD_BRIDGE exists: deploy/local/down.sh first"

t0=$(date +%s)
rm -rf "$S/etcd" "$S/kubelet" "$S/log" "$S/run" "$S/cni-ipam" "$S/pod-logs"
mkdir -p "$S"/{pki,run,log,cni,cni-ipam,kubelet,pod-logs,containerd-root} "$RUN"

# --- network: the pod bridge with the node's address, a route to services, FORWARD accepted -----
ip link add "$POD_BRIDGE" type bridge
ip addr add "$IP/${POD_CIDR#*/}" dev "$POD_BRIDGE"
ip link set "$POD_BRIDGE" up
ip route add "$SERVICE_CIDR" dev "$POD_BRIDGE" src "$IP"
for dir in -i -o; do
  iptables -C FORWARD "$dir" "$POD_BRIDGE" -j ACCEPT -m comment --comment "$NAME_PREFIX" 2>/dev/null \
    || iptables -I FORWARD 1 "$dir" "$POD_BRIDGE" -j ACCEPT -m comment --comment "$NAME_PREFIX"
done

# --- certificates: one CA; the API server's; one client certificate for every component --------
pki=$S/pki
ssl() { openssl "$@" >/dev/null 2>&1 || fail "openssl $1 failed"; }
if [ ! -f "$pki/ca.crt" ]; then
  ssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$pki/ca.key"
  ssl req -x509 -new -key "$pki/ca.key" -subj "/CN=kvxfer-local-k8s-ca" -days 3650 \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" -out "$pki/ca.crt"
  issue() { # name subject ext
    ssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$pki/$1.key"
    ssl req -new -key "$pki/$1.key" -subj "$2" -out "$pki/$1.csr"
    printf '%s\n' "$3" >"$pki/$1.ext"
    ssl x509 -req -in "$pki/$1.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial -days 3650 \
      -extfile "$pki/$1.ext" -out "$pki/$1.crt"
    rm -f "$pki/$1.csr" "$pki/$1.ext"
  }
  issue apiserver "/CN=kube-apiserver" "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=IP:$IP,IP:$API_SERVICE_IP,IP:127.0.0.1,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
  # The components and the tests act as cluster admins (system:masters): one node, no tenants.
  issue admin "/O=system:masters/CN=kvxfer-admin" "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
  ssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out "$pki/sa.key"
  ssl pkey -in "$pki/sa.key" -pubout -out "$pki/sa.pub"
fi
cat >"$KUBECONFIG_FILE" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: kvxfer-local
  cluster: {server: "https://$IP:6443", certificate-authority: "$pki/ca.crt"}
users:
- name: admin
  user: {client-certificate: "$pki/admin.crt", client-key: "$pki/admin.key"}
contexts:
- name: kvxfer-local
  context: {cluster: kvxfer-local, user: admin}
current-context: kvxfer-local
EOF

start() { # name argv...: a daemon of ours, its pid in run/<name>.pid, its output in log/<name>.log
  local name=$1; shift
  setsid "$@" >"$S/log/$name.log" 2>&1 </dev/null &
  echo $! >"$S/run/$name.pid"
}
wait_until() { # what seconds command...
  local what=$1 secs=$2; shift 2
  for _ in $(seq 1 $((secs * 5))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
  fail "$what not up within $secs s (logs: $S/log/)"
}
KUBECTL=("$BIN/kubectl" --kubeconfig "$KUBECONFIG_FILE")

# --- etcd, the API server, the controller manager, the scheduler --------------------------------
start etcd etcd --name kvxfer --data-dir "$S/etcd" \
  --listen-client-urls "http://$IP:2379" --advertise-client-urls "http://$IP:2379" \
  --listen-peer-urls "http://$IP:2380" --initial-advertise-peer-urls "http://$IP:2380" \
  --initial-cluster "kvxfer=http://$IP:2380" --log-level warn
wait_until etcd 30 curl -sf "http://$IP:2379/health"
start kube-apiserver "$BIN/kube-apiserver" --etcd-servers "http://$IP:2379" \
  --bind-address "$IP" --advertise-address "$IP" --secure-port 6443 \
  --service-cluster-ip-range "$SERVICE_CIDR" \
  --tls-cert-file "$pki/apiserver.crt" --tls-private-key-file "$pki/apiserver.key" --client-ca-file "$pki/ca.crt" \
  --service-account-issuer https://kubernetes.default.svc.cluster.local \
  --service-account-key-file "$pki/sa.pub" --service-account-signing-key-file "$pki/sa.key" \
  --authorization-mode RBAC --kubelet-client-certificate "$pki/admin.crt" --kubelet-client-key "$pki/admin.key" \
  --kubelet-preferred-address-types InternalIP,Hostname \
  --profiling=false --v=1
wait_until "the API server" 90 "${KUBECTL[@]}" get --raw /readyz
start kube-controller-manager "$BIN/kube-controller-manager" --kubeconfig "$KUBECONFIG_FILE" \
  --service-account-private-key-file "$pki/sa.key" --root-ca-file "$pki/ca.crt" \
  --cluster-cidr "$POD_CIDR" --service-cluster-ip-range "$SERVICE_CIDR" --leader-elect=false \
  --secure-port 0 --profiling=false --v=1
start kube-scheduler "$BIN/kube-scheduler" --kubeconfig "$KUBECONFIG_FILE" --leader-elect=false \
  --secure-port 0 --profiling=false --v=1

# --- containerd (CRI), its CNI network, the images --------------------------------------------
cat >"$S/cni/10-kvxfer.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "$NAME_PREFIX",
  "plugins": [
    {
      "type": "bridge", "bridge": "$POD_BRIDGE", "isGateway": true, "ipMasq": false, "hairpinMode": true,
      "ipam": {"type": "host-local", "dataDir": "$S/cni-ipam", "ranges": [[{"subnet": "$POD_CIDR", "gateway": "$IP"}]]}
    }
  ]
}
EOF
cat >"$S/containerd.toml" <<EOF
version = 2
root = "$S/containerd-root"
state = "$RUN/containerd"
[grpc]
  address = "$RUN/containerd.sock"
[ttrpc]
  address = "$RUN/containerd.sock.ttrpc"
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "$S/containerd-opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "docker.io/library/kvxfer-pause:local"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  # Root here lacks CAP_SYS_RESOURCE: lowering an OOM score adjustment is refused.
  restrict_oom_score_adj = true
  disable_apparmor = true
  # Pods' network namespaces under the state folder, so that down.sh finds exactly ours.
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "$(command -v runc)"
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$S/cni"
EOF
start containerd containerd --config "$S/containerd.toml" --log-level warn
CTR=(ctr --address "$RUN/containerd.sock" --namespace k8s.io)
wait_until containerd 30 "${CTR[@]}" version
t_img=$(date +%s)
bash deploy/local/import-images.sh "$RUN/containerd.sock" "$S/containerd-root/.kvxfer-images" \
  || fail "could not import the images into containerd"
say "images in containerd ($(( $(date +%s) - t_img )) s)"

# --- the kubelet, kube-proxy, CoreDNS ------------------------------------------------------------
cat >"$S/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: "$IP"
port: 10250
readOnlyPort: 0
healthzBindAddress: "$IP"
healthzPort: 10248
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: "$pki/ca.crt"}
authorization: {mode: AlwaysAllow}
containerRuntimeEndpoint: "unix://$RUN/containerd.sock"
cgroupDriver: cgroupfs
# This VM's cgroups are v1, which the kubelet refuses from 1.35 unless told otherwise.
failCgroupV1: false
failSwapOn: false
clusterDNS: ["$IP"]
clusterDomain: cluster.local
podLogsDir: "$S/pod-logs"
# A shared machine's disk is never the node's to guard: no eviction on disk use.
evictionHard: {memory.available: "200Mi", nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}
imageGCHighThresholdPercent: 100
serializeImagePulls: false
EOF
start kubelet "$BIN/kubelet" --config "$S/kubelet.yaml" --kubeconfig "$KUBECONFIG_FILE" \
  --root-dir "$S/kubelet" --hostname-override "$NODE" --node-ip "$IP" --v=1
cat >"$S/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: iptables
clusterCIDR: "$POD_CIDR"
hostnameOverride: "$NODE"
bindAddress: "$IP"
healthzBindAddress: "$IP:10256"
metricsBindAddress: "$IP:10249"
clientConnection: {kubeconfig: "$KUBECONFIG_FILE"}
conntrack: {maxPerCore: 0}
EOF
start kube-proxy "$BIN/kube-proxy" --config "$S/kube-proxy.yaml" --v=1
cat >"$S/Corefile" <<EOF
.:53 {
    bind $IP
    errors
    kubernetes cluster.local in-addr.arpa ip6.arpa {
        kubeconfig $KUBECONFIG_FILE
        pods insecure
        ttl 2
    }
    cache 2
}
EOF
start coredns "$BIN/coredns" -conf "$S/Corefile"

node_ready() {
  [ "$("${KUBECTL[@]}" get node "$NODE" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}')" = True ]
}
wait_until "the node" 90 node_ready
wait_until "the default service account" 60 "${KUBECTL[@]}" get serviceaccount default -n default
say "Kubernetes $K8S_VERSION up in $(( $(date +%s) - t0 )) s: node $NODE ($IP), pods $POD_CIDR, services $SERVICE_CIDR"
echo "KUBECONFIG=$KUBECONFIG_FILE"
