# Every version the local cluster is made of, in one place (sourced by deploy/local/*.sh).
# Kubernetes and CoreDNS are built from the Go module proxy (build.sh); etcd, containerd, runc,
# the CNI plugins and Docker come from Debian 12's apt (up.sh installs what is missing).
K8S_VERSION=v1.34.4
COREDNS_VERSION=v1.12.4
K8S_BIN=.tools/k8s-$K8S_VERSION/bin
# Debian packages the cluster and the image builds need (bookworm's versions: docker.io 20.10,
# containerd 1.6, etcd 3.4, containernetworking-plugins 1.1).
CLUSTER_APT_PACKAGES="docker.io containerd runc etcd-server containernetworking-plugins iptables debootstrap conntrack"
# The addresses the cluster and Docker use, all inside 198.19.128.0/17 (part of 198.18.0.0/15, the
# benchmarking range the project's network rule allows): Docker's bridge and its pool, the pod
# bridge, the service range.
DOCKER_BIP=198.19.128.1/24
DOCKER_POOL=198.19.129.0/24
POD_CIDR=198.19.160.0/20
POD_GATEWAY=198.19.160.1
SERVICE_CIDR=198.19.192.0/20
API_SERVICE_IP=198.19.192.1
# Names of what the cluster creates on the host, prefixed so that nothing of anyone else's is touched.
NAME_PREFIX=kvxfer-k8s
POD_BRIDGE=kvx-cni0
# Debian's docker client (20.10, as its daemon; it builds with BuildKit without a buildx plugin),
# whatever other `docker` the PATH has first.
DOCKER=/usr/bin/docker
