"""A real HTTP server on 127.0.0.1 speaking the OpenAI chat-completions API, answering from
a script, for tests of the ``llm`` segmenter's wire protocol and its handling of bad answers
(malformed JSON, invalid segments, 429, 500), which a real model cannot be made to produce on
demand. Every request is recorded (headers, lower-cased, and body)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any

from tests.local_http import LocalServer, send_json

#: A script entry: an HTTP status (an error answer), or the text of the model's answer.
Reply = int | str


class ChatServer(LocalServer):
    """Answers ``POST /v1/chat/completions``. ``reply(request_body, n)`` gives the n-th
    request's :data:`Reply`; by default, the next item of ``script`` (then ``default``)."""

    def __init__(self, script: list[Reply] | None = None,
                 reply: Callable[[dict[str, Any], int], Reply] | None = None,
                 reject_response_format: bool = False) -> None:
        self.script = list(script or [])
        self.reply = reply or (lambda body, n: self.script.pop(0))
        self.reject_response_format = reject_response_format
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    n = len(server.requests)
                    server.requests.append({"headers": {k.lower(): v for k, v in self.headers.items()},
                                            "body": body})
                    if server.reject_response_format and "response_format" in body:
                        answer: Reply = 400
                    else:
                        answer = server.reply(body, n)
                if isinstance(answer, int):
                    self._send(answer, {"error": {"message": f"scripted {answer}",
                                                  "type": "scripted"}},
                               {"Retry-After": "0"} if answer == 429 else {})
                    return
                self._send(200, {
                    "id": f"chatcmpl-{n}", "object": "chat.completion",
                    "created": int(time.time()), "model": body["model"],
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": answer}}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

            def _send(self, status: int, payload: dict[str, Any],
                      headers: dict[str, str] | None = None) -> None:
                send_json(self, status, payload, headers)

        super().__init__(Handler)
