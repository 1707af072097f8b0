#!/usr/bin/env bash
# `npm run test:cluster`: kvxfer deployed as users deploy it (needs root). Installs what is missing
# from apt (deploy/local/setup.sh), builds Kubernetes into .tools once (deploy/local/build.sh:
# 6-15 min on 2 cores the first time, nothing after), builds the images with kvxfer's own
# dockerd (deploy/local/images.sh: a few minutes the first time, seconds when nothing changed),
# then runs deploy/local/tests: the chart's engine pods by hand with Docker (test_pod.py), and the
# chart on a single-node Kubernetes it brings up and tears down (test_cluster.py). The dockerd is
# stopped again at the end if this started it; the cluster always is.
set -euo pipefail
cd "$(dirname "$0")/../.."
source deploy/local/versions.sh

t0=$(date +%s)
step() { echo "kvxfer test:cluster: $1 ($(( $(date +%s) - t0 )) s)"; }
bash deploy/local/setup.sh
bash scripts/setup-helm.sh
bash deploy/local/build.sh
step "Kubernetes $K8S_VERSION ready"
eval "$(bash deploy/local/docker.sh env)"
export DOCKER_HOST
started=""
if ! "$DOCKER" version >/dev/null 2>&1; then
  bash deploy/local/docker.sh start
  started=yes
fi
trap '[ -n "$started" ] && bash deploy/local/docker.sh stop' EXIT
bash deploy/local/images.sh
step "images built"
.venv/bin/python -m pytest -q -p no:cacheprovider -s deploy/local/tests
step "done"
