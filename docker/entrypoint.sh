#!/bin/sh
# lineside container entrypoint (Dockerfile.jetson): build the TensorRT engine on the first start on a
# device (kept in the bundle volume), then serve. Signals reach the server (exec) so it can drain.
set -eu

BUNDLE="${LINESIDE_BUNDLE:-/bundle}"
HOST="${LINESIDE_HOST:-0.0.0.0}"
PORT="${LINESIDE_PORT:-8000}"
LINESIDE="${LINESIDE_BIN:-lineside}"

if [ ! -f "$BUNDLE/manifest.json" ]; then
    echo "error: no lineside bundle at $BUNDLE; mount one: docker run -v /path/to/bundle:$BUNDLE ..." >&2
    exit 1
fi

# First start on this device (or after an L4T / TensorRT change): build the engine into the bundle
# volume; later starts find it there. LINESIDE_ENGINE_ARGS passes options to `lineside engine`.
"$LINESIDE" jetson ensure-engine "$BUNDLE"

exec "$LINESIDE" serve "$BUNDLE" --host "$HOST" --port "$PORT" "$@"
