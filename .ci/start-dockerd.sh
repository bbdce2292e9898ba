#!/bin/sh
# Usage: start-dockerd.sh [PIDFILE]
# Start a private dockerd for CI, write its pid to PIDFILE if given, and print the lines to `eval`:
#   export DOCKER_HOST=unix://<dir>/docker.sock
#   export TRAJGEN_DOCKERD_PIDFILE=<dir>/pid
# It never touches the host network (no bridge, no iptables) and creates no networks, so
# every container must run with --network none. Idempotent: a dockerd already answering
# on the socket is reused. Stop it with: kill "$(cat "$TRAJGEN_DOCKERD_PIDFILE")"
set -eu
dir=${TRAJGEN_DOCKERD_DIR:-/tmp/trajgen-ci-dockerd}
host="unix://$dir/docker.sock"
mkdir -p "$dir"
if ! docker -H "$host" info >/dev/null 2>&1; then
    dockerd --bridge=none --iptables=false --ip6tables=false \
        --data-root "$dir/data" --exec-root "$dir/exec" --pidfile "$dir/pid" \
        --host "$host" >"$dir/dockerd.log" 2>&1 &
    tries=0
    until docker -H "$host" info >/dev/null 2>&1; do
        tries=$((tries + 1))
        if [ "$tries" -gt 120 ] || ! kill -0 "$!" 2>/dev/null; then
            echo "dockerd did not start; last log lines:" >&2
            tail -n 5 "$dir/dockerd.log" >&2
            kill "$!" 2>/dev/null || true
            exit 1
        fi
        sleep 0.5
    done
fi
if [ $# -ge 1 ]; then
    cat "$dir/pid" >"$1"
fi
echo "export DOCKER_HOST=$host"
echo "export TRAJGEN_DOCKERD_PIDFILE=$dir/pid"
