#!/usr/bin/env bash
# The GPU paths end to end on one GPU, unattended: DeepSpeed ZeRO-2 (and ZeRO-3 with LoRA) in
# bfloat16 chosen by `model.dtype: auto`, the hf backend's bfloat16 KV cache on CUDA, and the
# official vLLM wheel serving pi_ref for collection through `rollout.backend: openai`.
#
#   bash scripts/gpu_check.sh [--out DIR] [--no-install] [--set SECTION.KEY=VALUE ...]
#   bash scripts/gpu_check.sh --dry-run --no-install      (or DRY_RUN=1): the same steps on a CPU
#
# Steps (each one's wall time, tokens/s where its stage reports them, peak GPU memory and peak
# RSS go to DIR/steps/<step>.json; DIR/summary.json has them all with the commit, date, GPU
# and versions): install_project (EXTRAS=gpu scripts/setup.sh), install_vllm
# (scripts/vllm_env.sh), probe, params, prefect_server, expert, sft (builtin:base, DeepSpeed
# ZeRO-2, 300 steps), serve_vllm (scripts/serve_vllm.sh pi_ref), collect_vllm (openai backend),
# collect_hf (the same collection in process: the tokens/s comparison), segment, sprm,
# hindsight, rewards, ppo (hisr, 2 iterations, DeepSpeed), evaluate (the PPO policy),
# sft_lora (LoRA under ZeRO-3). Sizes: scripts/gpu_check.py (GPU, DRY, LORA_*); --set
# overrides any param of every step. The first failing step stops the check, named, with the
# end of its log (DIR/logs/<step>.log); servers it started are stopped on any exit.
#
# --dry-run: builtin:tiny, plain torch, the hf backend (no vLLM), minimal sizes: the same
# sequence on a CPU in a few minutes. --no-install: use the existing environments (VENV,
# default .venv; VLLM_VENV, default .venv-vllm). The install needs network access; on a GPU
# machine PyPI's torch is the CUDA build. DIR defaults to benchmarks/results/gpu/<UTC time>;
# its work/ (models, data, MLflow store) and logs/ are not for git.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
# The interpreter scripts/setup.sh builds .venv from also runs the step runner (stdlib only).
HOST_PY=${PYTHON:-python3.11}
HELPER=$ROOT/scripts/gpu_check.py
MODE=gpu
[ "${DRY_RUN:-0}" = 1 ] && MODE=dry
INSTALL=1
OUT=""
SETS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) MODE=dry ;;
    --no-install) INSTALL=0 ;;
    --out) OUT=${2:?--out needs a folder}; shift ;;
    --set) SETS+=(--set "${2:?--set needs SECTION.KEY=VALUE}"); shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
OUT=${OUT:-benchmarks/results/gpu/$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
if [ -e "$OUT/steps.txt" ]; then
  echo "gpu_check: $OUT already holds a check; give another --out" >&2
  exit 2
fi
WORK=$OUT/work
DATA=$WORK/data
mkdir -p "$WORK" "$OUT/logs"
: >"$OUT/steps.txt"

absolute() { echo "$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"; }
VENV=$(absolute "${VENV:-.venv}")
VLLM_VENV=$(absolute "${VLLM_VENV:-.venv-vllm}")
export VLLM_VENV
PY=$VENV/bin/python
# This checkout's code, whatever the environment's editable install points at.
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 DO_NOT_TRACK=true TOKENIZERS_PARALLELISM=false \
  PREFECT_SERVER_ANALYTICS_ENABLED=false MLFLOW_DISABLE_TELEMETRY=true \
  PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=120 PYTHONUNBUFFERED=1
# Compiled ops (the CPU decode kernel, DeepSpeed's) are built once per checkout, not per check.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$ROOT/.cache/torch_extensions}
if [ "$MODE" = dry ]; then
  # A tiny model gains nothing from more threads, and a shared CPU loses much to them.
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi

CURRENT=""
SERVERS=()
free_port() {
  "$HOST_PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])'
}

# Start a server in its own process group (setsid), so that stopping it stops its children.
start_server() {  # LOG CMD... ; sets SERVER_PID
  local log=$1; shift
  setsid "$@" >"$log" 2>&1 &
  SERVER_PID=$!
  SERVERS+=("$SERVER_PID")
}

stop_server() {  # PID: SIGTERM to its group, SIGKILL after 30 s
  local pid=$1 i kept=()
  # Off the list first: a group id can be reused once it is gone.
  for i in "${SERVERS[@]}"; do [ "$i" = "$pid" ] || kept+=("$i"); done
  SERVERS=("${kept[@]}")
  kill -TERM -- "-$pid" 2>/dev/null || return 0
  for i in $(seq 60); do
    kill -0 -- "-$pid" 2>/dev/null || return 0
    sleep 0.5
  done
  echo "gpu_check: server $pid ignored SIGTERM for 30 s; killing it" >&2
  kill -KILL -- "-$pid" 2>/dev/null || true
}

finish() {
  local rc=$? pid
  trap - EXIT INT TERM
  for pid in "${SERVERS[@]}"; do stop_server "$pid"; done
  "$HOST_PY" "$HELPER" summary --out "$OUT" --mode "$MODE" --rc "$rc" \
    ${CURRENT:+--current "$CURRENT"} || rc=1
  exit "$rc"
}
trap finish EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

step() {  # NAME [--metrics FILE] [--model-dir DIR] -- CMD...
  CURRENT=$1
  echo "$1" >>"$OUT/steps.txt"
  "$HOST_PY" "$HELPER" step "$1" --out "$OUT" "${@:2}"
}

skip() {  # NAME REASON
  echo "$1" >>"$OUT/steps.txt"
  "$HOST_PY" "$HELPER" skip "$1" --out "$OUT" --reason "$2"
}

echo "gpu_check: mode $MODE, output $OUT"

# -- environments --------------------------------------------------------------------------------
if [ "$INSTALL" = 1 ]; then
  if [ "$MODE" = gpu ]; then
    step install_project -- env EXTRAS=gpu bash scripts/setup.sh
    step install_vllm -- bash scripts/vllm_env.sh
  else
    step install_project -- bash scripts/setup.sh
  fi
  # setup.sh installs into the checkout's .venv.
  VENV=$ROOT/.venv
  PY=$VENV/bin/python
fi
if [ ! -x "$PY" ]; then
  echo "gpu_check: no Python environment at $VENV (run without --no-install, or set VENV)" >&2
  exit 2
fi
if [ "$MODE" = gpu ]; then
  step probe -- "$PY" "$HELPER" probe --mode gpu --out "$OUT" --vllm-python "$VLLM_VENV/bin/python"
else
  step probe -- "$PY" "$HELPER" probe --mode dry --out "$OUT"
fi
VLLM_PORT=$(free_port)
step params -- "$PY" "$HELPER" params --mode "$MODE" --out "$OUT" --vllm-port "$VLLM_PORT" \
  "${SETS[@]}"
P=$OUT/params.yaml

if [ -n "${PREFECT_API_URL:-}" ]; then
  skip prefect_server "PREFECT_API_URL is set: flows report to that server"
else
  # One API server for every stage (a flow without one starts its own, ~10 s each).
  PREFECT_PORT=$(free_port)
  start_server "$OUT/logs/prefect_server_process.log" env PREFECT_HOME="$WORK/prefect" \
    PREFECT_UI_ENABLED=false "$VENV/bin/prefect" server start --host 127.0.0.1 \
    --port "$PREFECT_PORT"
  step prefect_server -- "$HOST_PY" "$HELPER" wait-http \
    "http://127.0.0.1:$PREFECT_PORT/api/health" --pid "$SERVER_PID" \
    --log "$OUT/logs/prefect_server_process.log" --timeout 180
  export PREFECT_API_URL=http://127.0.0.1:$PREFECT_PORT/api PREFECT_HOME=$WORK/prefect
fi

# -- the pipeline --------------------------------------------------------------------------------
step expert --metrics "$DATA/expert/metrics.json" -- \
  "$PY" -m flows.expert --params "$P" --data "$DATA"
step sft --metrics "$DATA/sft/metrics.json" --model-dir "$DATA/sft/pi_ref" -- \
  "$PY" -m flows.sft --params "$P" --data "$DATA"
PI_REF=$DATA/sft/pi_ref

if [ "$MODE" = gpu ]; then
  # The served model name is the folder as given, which rollout.openai.model: null expects.
  start_server "$OUT/logs/vllm_server_process.log" env VLLM_VENV="$VLLM_VENV" \
    bash scripts/serve_vllm.sh "$PI_REF" "$VLLM_PORT" \
    --gpu-memory-utilization "${VLLM_GPU_MEMORY_UTILIZATION:-0.5}"
  VLLM_PID=$SERVER_PID
  step serve_vllm -- "$HOST_PY" "$HELPER" wait-http "http://127.0.0.1:$VLLM_PORT/v1/models" \
    --pid "$VLLM_PID" --log "$OUT/logs/vllm_server_process.log" --timeout 300
  step collect_vllm --metrics "$DATA/collect/metrics.json" -- \
    "$PY" -m flows.collect --params "$OUT/params_openai.yaml" --data "$DATA" --model "$PI_REF"
  mv "$DATA/collect" "$DATA/collect_vllm"
  # Its GPU memory goes back before the in-process collection and the training steps.
  stop_server "$VLLM_PID"
else
  skip serve_vllm "dry run: no vLLM (the hf backend collects)"
  skip collect_vllm "dry run: no vLLM (the hf backend collects)"
fi
# The same collection in process; its D_ct feeds the later stages.
step collect_hf --metrics "$DATA/collect/metrics.json" -- \
  "$PY" -m flows.collect --params "$P" --data "$DATA" --model "$PI_REF"
step segment --metrics "$DATA/segment/metrics.json" -- \
  "$PY" -m flows.segment --params "$P" --data "$DATA"
step sprm --metrics "$DATA/sprm/metrics.json" -- \
  "$PY" -m flows.sprm --params "$P" --data "$DATA"
step hindsight --metrics "$DATA/hindsight/metrics.json" --model-dir "$DATA/hindsight/pi_hind" -- \
  "$PY" -m flows.hindsight --params "$P" --data "$DATA"
step rewards --metrics "$DATA/rewards/metrics.json" -- \
  "$PY" -m flows.rewards --params "$P" --data "$DATA"
POLICY=$DATA/ppo/hisr/seed0/models/policy
step ppo --metrics "$DATA/ppo/hisr/seed0/metrics.json" --model-dir "$POLICY" -- \
  "$PY" -m flows.ppo --variant hisr --seed 0 --params "$P" --data "$DATA"
step evaluate --metrics "$DATA/eval/hisr/seed0/metrics.json" -- \
  "$PY" -m flows.evaluate --model "$POLICY" --name hisr/seed0 --params "$P" --data "$DATA"

# LoRA on the same model and D_bc, in a data folder of its own (pi_ref stays as trained).
mkdir -p "$WORK/lora"
ln -sfn "$DATA/expert" "$WORK/lora/expert"
step sft_lora --metrics "$WORK/lora/sft/metrics.json" --model-dir "$WORK/lora/sft/pi_ref" -- \
  "$PY" -m flows.sft --params "$OUT/params_lora.yaml" --data "$WORK/lora"
CURRENT=""
