#!/usr/bin/env bash
# A Docker daemon of kvxfer's own (Debian's docker.io), for building the images and for the pod
# test: its socket, state and run folders are its own, so it never meets another dockerd's.
#
#   deploy/local/docker.sh start    start it unless it runs; prints nothing else on success
#   deploy/local/docker.sh stop     stop it if it runs (only the one whose pid file is ours), and
#                                   delete the bridge it made
#   deploy/local/docker.sh env      print DOCKER_HOST=... for `eval`
#
# Addresses: its bridge and its pool of networks are inside 198.19.128.0/17 (deploy/local/
# versions.sh); it writes no iptables rules (--iptables=false: it never sets FORWARD to DROP or
# adds NAT), so builds run with --network host and the pod test's containers talk over a bridge
# network of its pool without leaving the host. Images and build cache stay in .tools/docker, so
# removing .tools removes them.
set -euo pipefail
cd "$(dirname "$0")/../.."
source deploy/local/versions.sh

RUN=/run/kvxfer-docker
SOCK=$RUN/docker.sock
PIDFILE=$RUN/dockerd.pid
DATA=$PWD/.tools/docker
LOG=$PWD/.tools/dockerd.log
fail() { echo "kvxfer docker: $*" >&2; exit 1; }

running() { [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; }

case "${1:-}" in
  env)
    echo "DOCKER_HOST=unix://$SOCK"
    ;;
  start)
    if running; then
      [ "$(readlink -f /proc/"$(cat "$PIDFILE")"/cwd 2>/dev/null)" = "$PWD" ] || [ -S "$SOCK" ] \
        || fail "a dockerd with pid file $PIDFILE runs but has no socket at $SOCK"
      exit 0
    fi
    command -v dockerd >/dev/null || fail "no dockerd: apt-get install docker.io (deploy/local/setup.sh does)"
    if ip link show docker0 >/dev/null 2>&1 && ! ip -4 addr show docker0 | grep -q "inet ${DOCKER_BIP%/*}/"; then
      fail "a docker0 bridge with another address exists (another Docker daemon?): kvxfer's uses $DOCKER_BIP"
    fi
    mkdir -p "$RUN" "$DATA"
    # --exec-root must be short: containerd's sockets live under it.
    nohup dockerd --host "unix://$SOCK" --pidfile "$PIDFILE" --data-root "$DATA" --exec-root "$RUN/exec" \
      --bip "$DOCKER_BIP" --default-address-pool "base=$DOCKER_POOL,size=26" --iptables=false --ip-masq=false \
      --ip-forward=false --storage-driver overlay2 --log-level warn >"$LOG" 2>&1 </dev/null &
    for _ in $(seq 1 100); do
      if DOCKER_HOST=unix://$SOCK "$DOCKER" version >/dev/null 2>&1; then exit 0; fi
      sleep 0.3
    done
    tail -20 "$LOG" >&2
    fail "dockerd did not answer on $SOCK within 30 s (log: $LOG)"
    ;;
  stop)
    if running; then
      pid=$(cat "$PIDFILE")
      kill -TERM "$pid"
      for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
      kill -0 "$pid" 2>/dev/null && { kill -KILL "$pid"; sleep 0.5; }
    fi
    rm -f "$PIDFILE"
    # dockerd leaves its bridge behind; it is ours when it has our address.
    if ip -4 addr show docker0 2>/dev/null | grep -q "inet ${DOCKER_BIP%/*}/"; then ip link delete docker0; fi
    ;;
  *)
    echo "usage: deploy/local/docker.sh start|stop|env" >&2
    exit 2
    ;;
esac
