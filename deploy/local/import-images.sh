#!/usr/bin/env bash
# Copies the images deploy/local/images.sh built from kvxfer's dockerd into the cluster's
# containerd (namespace k8s.io, where the kubelet looks), as docker.io/library/<name>:local; the
# kubelet then finds them (imagePullPolicy IfNotPresent: nothing is pulled). Skipped when the
# image ids recorded in STAMP are the ones dockerd has.
#
#   deploy/local/import-images.sh CONTAINERD_SOCKET STAMP
set -euo pipefail
cd "$(dirname "$0")/../.."
source deploy/local/versions.sh
sock=$1 stamp=$2
eval "$(bash deploy/local/docker.sh env)"
export DOCKER_HOST
bash deploy/local/docker.sh start
images=(kvxfer:local kvxfer-engine:local kvxfer-router:local kvxfer-pause:local)
ids=$("$DOCKER" image inspect -f '{{.Id}}' "${images[@]}") || {
  echo "kvxfer cluster: images missing: build them with deploy/local/images.sh" >&2; exit 1; }
want=$(printf '%s\n' "${images[@]}" $ids | sha256sum | cut -d' ' -f1)
ctr=(ctr --address "$sock" --namespace k8s.io)
have=$("${ctr[@]}" images ls -q 2>/dev/null || true)
present=yes
for i in "${images[@]}"; do grep -qx "docker.io/library/$i" <<<"$have" || present=no; done
if [ "$present" = yes ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then exit 0; fi
"$DOCKER" save "${images[@]}" | "${ctr[@]}" images import - >/dev/null
echo "$want" >"$stamp"
