"""A small OpenAI-compatible completions server over a transformers model, for tests.

It speaks the part of vLLM's ``/v1/completions`` API the ``openai`` backend uses: a prompt of
token ids, ``max_tokens``, ``temperature``, ``top_p``, ``logprobs``, and vLLM's extras
``stop_token_ids`` and ``return_tokens_as_token_ids`` (the stop token is returned as the last
token, as vLLM does). It is a real HTTP server on 127.0.0.1 that the real ``openai`` client
talks to; tests use it where a vLLM server cannot run (vLLM itself is tested separately).
``fail_next`` makes the next requests answer 503 (the retry path); ``go_away_after`` and
``stop()`` take it away.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler
from typing import Any

import torch

from hisr_core.rollout.engine import Sampling
from hisr_core.rollout.hf import HFGenerator
from tests.local_http import LocalServer, send_json


class CompletionServer(LocalServer):
    def __init__(self, model: Any, tokenizer: Any, name: str = "tiny") -> None:
        self.model, self.tokenizer, self.name = model.eval(), tokenizer, name
        self.lock = threading.Lock()
        self.fail_next = 0
        self.requests = 0
        self.answers_left: int | None = None
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(length))
                with server.lock:
                    server.requests += 1
                    failing = server.fail_next > 0
                    server.fail_next -= failing
                if failing:
                    self._send(503, {"error": {"message": "overloaded", "type": "server_error"}})
                    return
                if self.path != "/v1/completions" or body.get("model") != server.name:
                    self._send(404, {"error": {"message": f"no {self.path} for "
                                               f"{body.get('model')!r}", "type": "not_found"}})
                    return
                with server.lock:
                    answer = server.complete(body)
                    if server.answers_left is not None:
                        server.answers_left -= 1
                        if server.answers_left <= 0:  # this is its last answer
                            threading.Thread(target=server.stop, daemon=True).start()
                self._send(200, answer)

            def _send(self, status: int, payload: dict[str, Any]) -> None:
                send_json(self, status, payload)

        super().__init__(Handler)

    def go_away_after(self, answers: int) -> None:
        """Answer ``answers`` more requests, then shut down (connections are refused)."""
        self.answers_left = answers

    @torch.inference_mode()
    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        prompt = [int(t) for t in body["prompt"]]
        stop = [int(t) for t in body.get("stop_token_ids") or [self.tokenizer.eos_token_id]]
        gen = HFGenerator(self.model, self.tokenizer, stop, seed=int(body.get("seed") or 0))
        sampling = Sampling(float(body.get("temperature", 1.0)), float(body.get("top_p", 1.0)),
                            int(body.get("max_tokens", 16)))
        out = gen.generate([prompt], sampling)[0]
        ids = list(out.token_ids)
        stopped = len(ids) < sampling.max_new_tokens
        if stopped:
            ids.append(stop[0])
        k = int(body.get("logprobs") or 0)
        logp = torch.log_softmax(self.model(torch.tensor([prompt + ids])).logits[0].float(), -1)
        tokens, token_lp, tops = [], [], []
        for j, t in enumerate(ids):
            row = logp[len(prompt) + j - 1]
            tokens.append(f"token_id:{t}")
            token_lp.append(float(row[t]))
            vals, idx = row.topk(k) if k else (row[:0], row[:0].long())
            tops.append({f"token_id:{int(i)}": float(v) for v, i in zip(vals, idx, strict=True)})
        return {
            "id": f"cmpl-{time.monotonic_ns()}", "object": "text_completion",
            "created": int(time.time()), "model": self.name,
            "choices": [{"index": 0, "text": out.text, "finish_reason":
                         "stop" if stopped else "length",
                         "logprobs": {"tokens": tokens, "token_logprobs": token_lp,
                                      "top_logprobs": tops, "text_offset": [0] * len(tokens)}}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                      "total_tokens": len(prompt) + len(ids)},
        }
