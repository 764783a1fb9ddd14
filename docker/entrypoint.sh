#!/bin/sh
# trtedge container entrypoint (Dockerfile.jetson): build the TensorRT engine on the first start on a
# device (kept in the bundle volume), then serve. Signals reach the server (exec) so it can drain.
set -eu

BUNDLE="${TRTEDGE_BUNDLE:-/bundle}"
HOST="${TRTEDGE_HOST:-0.0.0.0}"
PORT="${TRTEDGE_PORT:-8000}"
TRTEDGE="${TRTEDGE_BIN:-trtedge}"

if [ ! -f "$BUNDLE/manifest.json" ]; then
    echo "error: no trtedge bundle at $BUNDLE; mount one: docker run -v /path/to/bundle:$BUNDLE ..." >&2
    exit 1
fi

# First start on this device (or after an L4T / TensorRT change): build the engine into the bundle
# volume; later starts find it there. TRTEDGE_ENGINE_ARGS passes options to `trtedge engine`.
"$TRTEDGE" jetson ensure-engine "$BUNDLE"

exec "$TRTEDGE" serve "$BUNDLE" --host "$HOST" --port "$PORT" "$@"
