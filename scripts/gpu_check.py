"""The pieces of ``scripts/gpu_check.sh`` that are easier in Python than in bash.

    python scripts/gpu_check.py params --mode gpu|dry --out DIR [--vllm-port N] [--set K=V ...]
    python scripts/gpu_check.py probe --mode gpu|dry [--vllm-python PATH]
    python scripts/gpu_check.py step NAME --out DIR [--metrics FILE] [--model-dir DIR] -- CMD ...
    python scripts/gpu_check.py skip NAME --out DIR --reason TEXT
    python scripts/gpu_check.py wait-http URL --pid PID --log FILE [--timeout S]
    python scripts/gpu_check.py summary --out DIR --mode gpu|dry --rc N [--current NAME]

``step``, ``skip``, ``wait-http`` and ``summary`` use the standard library only: they run
before the project's environment exists (the install step), with the Python that
``scripts/setup.sh`` builds it from.
``params`` and ``probe`` import the project (its environment's interpreter runs them).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Self

ROOT = Path(__file__).resolve().parents[1]

# -- the check's parameters ------------------------------------------------------------------------
# Overrides deep-merged into params.yaml. GPU: builtin:base (the largest built-in shape) trained
# with DeepSpeed ZeRO-2 in bfloat16 (dtype auto must choose it), a few hundred SFT steps, then
# every stage once at a size that keeps the whole check under 10 minutes on one H100.
_DS = {"backend": "deepspeed", "zero_stage": 2}
GPU: dict[str, Any] = {
    "env": {"max_turns": 20},
    "expert": {"n_train": 400, "n_valid_seen": 32, "n_valid_unseen": 32},
    "model": {"name_or_path": "builtin:base", "dtype": "auto"},
    "sft": {**_DS, "max_steps": 300, "micro_batch_size": 16, "lr": 0.001, "log_every": 20},
    # An explicit cache dtype: the GPU path of the hf backend's KV cache in bfloat16.
    "rollout": {"backend": "hf", "batch_size": 64, "max_new_tokens": 48, "kv_dtype": "bfloat16"},
    "evaluate": {"splits": ["valid_seen"], "n_tasks": 32},
    "collect": {"n_tasks": 32, "samples_per_task": 4},
    "sprm": {**_DS, "max_steps": 30, "micro_batch_size": 8, "log_every": 5},
    "hindsight": {**_DS, "max_steps": 30, "log_every": 5},
    "ppo": {**_DS, "iterations": 2, "tasks_per_iter": 8, "samples_per_task": 2,
            "checkpoint_every": 1},
}
# The same sequence at the smallest sizes, on a CPU: builtin:tiny, plain torch, hf backend.
_TORCH = {"backend": "torch", "micro_batch_size": 4, "log_every": 1}
DRY: dict[str, Any] = {
    "env": {"max_turns": 6},
    "expert": {"n_train": 16, "n_valid_seen": 4, "n_valid_unseen": 4},
    "model": {"name_or_path": "builtin:tiny", "max_tokens": 512, "dtype": "auto"},
    "sft": {**_TORCH, "max_steps": 4},
    "rollout": {"backend": "hf", "batch_size": 8, "max_new_tokens": 24},
    "evaluate": {"splits": ["valid_seen"], "n_tasks": 4},
    "collect": {"n_tasks": 4, "samples_per_task": 2, "max_unparsed": 6, "loop_repeats": 6},
    "sprm": {**_TORCH, "max_steps": 2},
    "hindsight": {**_TORCH, "max_steps": 2},
    "rewards": {"cases": 1},
    "ppo": {"iterations": 2, "tasks_per_iter": 2, "samples_per_task": 2, "ppo_epochs": 1,
            "minibatches": 1, "micro_batch_size": 2, "backend": "torch", "checkpoint_every": 1},
}
# The LoRA run: SFT of the same model with adapters, under ZeRO-3 on a GPU (parameters
# partitioned, gathered to save).
LORA_GPU = {"model": {"lora": {"enabled": True}},
            "sft": {"zero_stage": 3, "max_steps": 50, "lr": 0.0005}}
LORA_DRY = {"model": {"lora": {"enabled": True}}, "sft": {"max_steps": 2, "lr": 0.0005}}


def parse_set(items: list[str]) -> dict[str, Any]:
    """``section.key=value`` pairs (the value read as YAML) as one nested mapping."""
    import yaml

    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise SystemExit(f"error: --set takes SECTION.KEY=VALUE, got {item!r}")
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(raw)
    return out


def write_params(mode: str, out: Path, vllm_port: int, sets: list[str],
                 base: Path = ROOT / "params.yaml") -> dict[str, Path]:
    """Write the check's params files under ``out``, each validated as the stages will:
    ``params.yaml`` (every stage), ``params_openai.yaml`` (collection through the vLLM
    server) and ``params_lora.yaml`` (the LoRA SFT run). Returns their paths."""
    import yaml

    from hisr_core.config import load_params, merge_params

    overrides = GPU if mode == "gpu" else DRY
    tracking = {"tracking": {"mlflow_uri": f"sqlite:///{out / 'work' / 'mlflow.db'}",
                             "experiment": "gpu-check"}}
    main = merge_params(merge_params(merge_params(yaml.safe_load(base.read_text()), overrides),
                                     tracking), parse_set(sets))
    openai = merge_params(main, {"rollout": {"backend": "openai", "openai": {
        "base_url": f"http://127.0.0.1:{vllm_port}/v1", "model": None}}})
    lora = merge_params(main, LORA_GPU if mode == "gpu" else LORA_DRY)
    paths = {}
    for name, data in (("params", main), ("params_openai", openai), ("params_lora", lora)):
        path = out / f"{name}.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        load_params(path)  # a bad override stops here, naming the key
        paths[name] = path
    return paths


# -- the environment -------------------------------------------------------------------------------
def probe(mode: str, vllm_python: str | None) -> dict[str, Any]:
    """What this machine runs: versions, the GPU, and what ``auto`` resolves to. On a GPU,
    ``model.dtype: auto`` must give bfloat16 and ``backend: auto`` DeepSpeed (else the check
    would measure another path than the one it claims to)."""
    import torch

    from hisr_core.train.engine import resolve_backend, resolve_dtype

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _emit import provenance  # the benchmarks' record of commit, machine and versions

    facts: dict[str, Any] = {
        **provenance(), "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
        "gpu_memory_mib": (torch.cuda.get_device_properties(0).total_memory // 2**20
                           if torch.cuda.is_available() else None),
        "auto_dtype": str(resolve_dtype("auto")).removeprefix("torch."),
        "auto_backend": resolve_backend("auto"),
    }
    if mode == "gpu":
        wrong = {k: facts[k] for k, want in (("cuda_available", True), ("auto_dtype", "bfloat16"),
                                              ("auto_backend", "deepspeed")) if facts[k] != want}
        if wrong:
            raise SystemExit(f"error: not the GPU paths this check is for: {wrong} (want CUDA, "
                             "auto dtype bfloat16, auto backend deepspeed; --dry-run on a CPU)")
    if vllm_python:
        got = subprocess.run([vllm_python, "-c", "import vllm; print(vllm.__version__)"],
                             capture_output=True, text=True, check=False)
        if got.returncode != 0:
            raise SystemExit(f"error: vLLM does not import in {vllm_python}:\n{got.stderr[-2000:]}")
        facts["vllm"] = got.stdout.strip().splitlines()[-1]
    return facts


# -- running one step ------------------------------------------------------------------------------
class GpuMemory:
    """Peak used GPU memory (MiB, all processes: a vLLM server counts) sampled by
    ``nvidia-smi`` every 200 ms while a step runs; None where there is no NVIDIA GPU."""

    def __init__(self) -> None:
        self.peak: int | None = None
        self._proc: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Self:
        if shutil.which("nvidia-smi") is None:
            return self
        self._proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
             "-lms", "200"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                used = sum(int(x) for x in line.split(",")) if "," in line else int(line)
            except ValueError:
                continue  # e.g. "[N/A]"
            self.peak = used if self.peak is None else max(self.peak, used)

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()
        if self._thread is not None:
            self._thread.join(timeout=5)


def rates(metrics: Any, prefix: str = "") -> dict[str, float]:
    """Every ``..._per_s`` value of a stage's metrics.json, by dotted path."""
    out: dict[str, float] = {}
    if isinstance(metrics, dict):
        for key, value in metrics.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            if isinstance(value, dict):
                out.update(rates(value, path))
            elif str(key).endswith("_per_s") and isinstance(value, int | float):
                out[path] = float(value)
    return out


def model_dtype(folder: Path) -> str | None:
    """The dtype a saved Hugging Face model folder declares (config.json)."""
    config = folder / "config.json"
    if not config.is_file():
        return None
    data = json.loads(config.read_text())
    return data.get("dtype") or data.get("torch_dtype")


def _write(out: Path, name: str, record: dict[str, Any]) -> None:
    (out / "steps").mkdir(parents=True, exist_ok=True)
    (out / "steps" / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no log at {path})"


def run_step(name: str, out: Path, cmd: list[str], metrics: Path | None,
             model_dir: Path | None) -> int:
    """Run ``cmd`` with its output in ``<out>/logs/<name>.log``; write
    ``<out>/steps/<name>.json`` (status, wall time, tokens/s from ``metrics``, peak GPU
    memory, peak RSS); on failure name the step and show the end of its log."""
    (out / "logs").mkdir(parents=True, exist_ok=True)
    log = out / "logs" / f"{name}.log"
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    start, started_at = time.monotonic(), time.time()
    with log.open("w") as sink, GpuMemory() as gpu:
        rc = subprocess.run(cmd, stdout=sink, stderr=subprocess.STDOUT, check=False).returncode
    wall = time.monotonic() - start
    record: dict[str, Any] = {
        "step": name, "status": "ok" if rc == 0 else "failed", "returncode": rc,
        "wall_s": round(wall, 2), "command": cmd, "log": str(log.relative_to(out)),
        "peak_gpu_memory_mib": gpu.peak,
        # ru_maxrss is in KiB on Linux: the largest process this step ran.
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1),
        "metrics_file": None, "rates": {}, "model_dtype": None,
    }
    if rc == 0 and metrics is not None:
        if not metrics.is_file() or metrics.stat().st_mtime < started_at:
            record.update(status="failed", error=f"the step wrote no {metrics}")
        else:
            record["metrics_file"] = str(metrics)
            record["rates"] = rates(json.loads(metrics.read_text()))
    if rc == 0 and model_dir is not None:
        record["model_dtype"] = model_dtype(model_dir)
    _write(out, name, record)
    if record["status"] != "ok":
        reason = record.get("error") or f"exit status {rc}"
        print(f"gpu_check: step '{name}' FAILED ({reason}) after {wall:.1f} s; "
              f"the end of {log}:\n{tail(log)}", file=sys.stderr, flush=True)
        return rc or 1
    print(json.dumps({k: record[k] for k in ("step", "status", "wall_s", "rates",
                                             "peak_gpu_memory_mib", "peak_rss_mib")}),
          flush=True)
    return 0


def wait_http(url: str, pid: int, log: Path, timeout: float) -> None:
    """Wait until ``url`` answers 200; fail with the end of ``log`` if process ``pid`` exits
    or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    print(f"{url} answers after {timeout - (deadline - time.monotonic()):.1f} s")
                    return
        except OSError:
            pass
        alive = Path(f"/proc/{pid}").exists()
        if not alive or time.monotonic() > deadline:
            why = "exited" if not alive else f"did not answer within {timeout:.0f} s"
            raise SystemExit(f"error: the server (pid {pid}) {why}; the end of {log}:\n"
                             f"{tail(log, 60)}")
        time.sleep(0.5)


# -- the summary -----------------------------------------------------------------------------------
def _git(*args: str) -> str | None:
    got = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
    return got.stdout.strip() if got.returncode == 0 else None


def summary(out: Path, mode: str, rc: int, current: str | None) -> dict[str, Any]:
    """``<out>/summary.json``: every step in the order run, the machine, the versions, and
    whether the whole check passed (the first failed step named)."""
    order = (out / "steps.txt").read_text().split() if (out / "steps.txt").is_file() else []
    steps = []
    for name in order:
        path = out / "steps" / f"{name}.json"
        steps.append(json.loads(path.read_text()) if path.is_file()
                     else {"step": name, "status": "failed", "error": "no record (interrupted)"})
    failed = next((s["step"] for s in steps if s["status"] == "failed"), None)
    if rc != 0 and failed is None:
        failed = current or "(between steps)"
    facts_path = out / "probe.json"
    facts = json.loads(facts_path.read_text()) if facts_path.is_file() else {}
    by_name = {s["step"]: s for s in steps}
    hf = by_name.get("collect_hf", {}).get("rates", {}).get("collect.speed.tokens_per_s")
    vllm = by_name.get("collect_vllm", {}).get("rates", {}).get("collect.speed.tokens_per_s")
    result = {
        "ok": rc == 0 and failed is None, "failed_step": failed, "mode": mode,
        # The commit as the probe found it (dirty: uncommitted changes to tracked files).
        "commit": facts.get("commit") or _git("rev-parse", "HEAD"), "dirty": facts.get("dirty"),
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "gpu": facts.get("gpu"),
        "versions": {k: facts.get(k) for k in
                     ("python", "torch", "cuda", "transformers", "deepspeed", "vllm")},
        "machine": facts,
        "wall_s": round(sum(s.get("wall_s", 0.0) for s in steps), 2),
        "collect_tokens_per_s": {"hf": hf, "vllm": vllm,
                                 "vllm_over_hf": round(vllm / hf, 2) if hf and vllm else None},
        "steps": steps,
    }
    (out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("params")
    p.add_argument("--mode", choices=["gpu", "dry"], required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--vllm-port", type=int, default=8000)
    p.add_argument("--set", action="append", default=[], dest="sets", metavar="K=V")
    p = sub.add_parser("probe")
    p.add_argument("--mode", choices=["gpu", "dry"], required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--vllm-python", default=None)
    p = sub.add_parser("step")
    p.add_argument("name")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--metrics", type=Path, default=None)
    p.add_argument("--model-dir", type=Path, default=None)
    p = sub.add_parser("skip")
    p.add_argument("name")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--reason", required=True)
    p = sub.add_parser("wait-http")
    p.add_argument("url")
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--log", type=Path, required=True)
    p.add_argument("--timeout", type=float, default=300)
    p = sub.add_parser("summary")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--mode", choices=["gpu", "dry"], required=True)
    p.add_argument("--rc", type=int, required=True)
    p.add_argument("--current", default=None)
    # A step's command is everything after the first "--", options of its own included.
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    argv, command = argv[:split], argv[split + 1:]
    args = parser.parse_args(argv)

    if args.cmd == "params":
        for path in write_params(args.mode, args.out, args.vllm_port, args.sets).values():
            print(path)
    elif args.cmd == "probe":
        facts = probe(args.mode, args.vllm_python)
        (args.out / "probe.json").write_text(json.dumps(facts, indent=2) + "\n")
        print(json.dumps(facts))
    elif args.cmd == "step":
        if not command:
            parser.error("step needs a command after --")
        raise SystemExit(run_step(args.name, args.out, command, args.metrics, args.model_dir))
    elif args.cmd == "skip":
        _write(args.out, args.name, {"step": args.name, "status": "skipped",
                                     "reason": args.reason, "wall_s": 0.0})
        print(f"== {args.name}: skipped ({args.reason})")
    elif args.cmd == "wait-http":
        wait_http(args.url, args.pid, args.log, args.timeout)
    else:
        result = summary(args.out, args.mode, args.rc, args.current)
        verdict = "OK" if result["ok"] else f"FAILED at step '{result['failed_step']}'"
        print(f"gpu_check ({result['mode']}): {verdict}; {len(result['steps'])} steps, "
              f"{result['wall_s']:.0f} s; {args.out / 'summary.json'}")


if __name__ == "__main__":
    main()
