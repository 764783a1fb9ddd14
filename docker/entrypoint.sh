#!/bin/sh
# trtedge container entrypoint (Dockerfile.jetson): build the TensorRT engine on the first start on a
# device (kept in the bundle volume), then serve. Signals reach the server (exec) so it can drain.
set -eu

BUNDLE="${TRTEDGE_BUNDLE:-/bundle}"
HOST="${TRTEDGE_HOST:-0.0.0.0}"
PORT="${TRTEDGE_PORT:-8000}"
ROOT="${TRTEDGE_SYSROOT:-}"   # tests point this at a fake device tree
TRTEDGE="${TRTEDGE_BIN:-trtedge}"

if [ ! -f "$BUNDLE/manifest.json" ]; then
    echo "error: no trtedge bundle at $BUNDLE; mount one: docker run -v /path/to/bundle:$BUNDLE ..." >&2
    exit 1
fi

# What the engine depends on: the board (host device tree), L4T, and the TensorRT in this image.
board=$(tr -d '\000' < "$ROOT/proc/device-tree/model" 2>/dev/null || echo unknown-board)
l4t=$(head -n 1 "$ROOT/etc/nv_tegra_release" 2>/dev/null | cut -d, -f1,2 || echo unknown-l4t)
trt=$(python3 -c 'import tensorrt; print(tensorrt.__version__)' 2>/dev/null || echo no-tensorrt)
key=$(printf '%s|%s|%s' "$board" "$l4t" "$trt" | sha256sum | cut -c1-16)
marker="$BUNDLE/engines/.entrypoint-built-$key"

if [ "${TRTEDGE_REBUILD:-0}" = "1" ] || [ ! -f "$marker" ]; then
    if [ ! -w "$BUNDLE" ]; then
        echo "error: $BUNDLE is read-only; the engine is built into $BUNDLE/engines on first start (mount it rw," \
             "owned by uid $(id -u))" >&2
        exit 1
    fi
    echo "trtedge: no engine built for this device yet ($board, $l4t, TensorRT $trt); building (takes minutes)" >&2
    "$TRTEDGE" engine "$BUNDLE"
    mkdir -p "$BUNDLE/engines"
    printf '%s\n%s\n%s\n' "$board" "$l4t" "$trt" > "$marker"
fi

exec "$TRTEDGE" serve "$BUNDLE" --host "$HOST" --port "$PORT" "$@"
