"""A scripted Ollama server (/api/chat, /api/generate): Ollama itself cannot run here,
so the tests and recordings of Ollama streams use this instead, and say so.

It speaks Ollama's wire format: a streamed answer is `application/x-ndjson`, chunked,
one compact JSON object per line (`model`, `created_at`, `message` or `response`, `done`),
the last with `done: true`, `done_reason`, the counts and durations in nanoseconds (and,
for generate, the `context`); `stream: false` gets one JSON object; an error mid-answer
is an `{"error": ...}` line. Its "model" writes one word per token, each chosen by a hash
of the server's name and everything before it, so an answer continued from a partial
assistant message (which, as in Ollama, is continued without being repeated) is a pure
function of that text; a generate request is rendered as the chat of its `system` and
`prompt`, as Ollama renders it, unless it is `raw`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
import time
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

WORDS = [
    "the",
    "river",
    "bridge",
    "stone",
    "water",
    "light",
    "under",
    "over",
    "quiet",
    "long",
    "old",
    "town",
    "night",
    "rain",
]
DEFAULT_TOKENS = 48


def next_word(name: str, context: str) -> str:
    digest = hashlib.sha256(f"{name}\n{context}".encode()).digest()
    return " " + WORDS[digest[0] % len(WORDS)]


def answer(name: str, messages: list[dict[str, Any]], tokens: int) -> list[str]:
    """The words this server writes for `messages` (a last assistant message continued)."""
    prefill = ""
    if messages and messages[-1].get("role") == "assistant":
        prefill = messages[-1].get("content") or ""
        messages = messages[:-1]
    context = "".join(f"<{m.get('role')}>{m.get('content')}" for m in messages) + "<assistant>"
    return written(name, context + prefill, tokens)


def generated(name: str, body: dict[str, Any], tokens: int) -> list[str]:
    """The words for a generate request: its prompt rendered as the chat Ollama makes of
    it (`system`, then `prompt` as the user's message), or taken as it is when `raw`."""
    if body.get("raw"):
        return written(name, body.get("prompt") or "", tokens)
    system = [{"role": "system", "content": body["system"]}] if body.get("system") else []
    return answer(name, [*system, {"role": "user", "content": body.get("prompt")}], tokens)


def written(name: str, context: str, tokens: int) -> list[str]:
    words: list[str] = []
    for _ in range(tokens):
        words.append(next_word(name, context + "".join(words)))
    return words


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


class OllamaUpstream:
    """`cut_after`: close the connection after that many words (a server that died);
    `error_after`: send an error line after that many words; `pause_s`: between words."""

    def __init__(
        self,
        name: str,
        *,
        cut_after: int | None = None,
        error_after: int | None = None,
        pause_s: float = 0.0,
    ) -> None:
        self.name = name
        self.cut_after = cut_after
        self.error_after = error_after
        self.pause_s = pause_s
        self.requests: list[dict[str, Any]] = []
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def handle(self) -> None:
                # A client that goes away (a proxy's cut) ends its connection quietly.
                with contextlib.suppress(ConnectionError):
                    super().handle()

            def do_GET(self) -> None:
                if self.path == "/":
                    self._send(200, b"Ollama is running", "text/plain; charset=utf-8")
                else:
                    self._send(404, b"404 page not found", "text/plain")

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                if self.path not in ("/api/chat", "/api/generate"):
                    self._send(404, b"404 page not found", "text/plain")
                    return
                upstream.requests.append(body)
                upstream._answer(self, body, chat=self.path == "/api/chat")

            def _send(self, status: int, data: bytes, kind: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def _answer(self, handler: BaseHTTPRequestHandler, body: dict[str, Any], chat: bool) -> None:
        options = body.get("options") or {}
        limit = options.get("num_predict") or DEFAULT_TOKENS
        if chat:
            words = answer(self.name, body.get("messages") or [], limit)
            said = [m.get("content") or "" for m in body.get("messages") or ()]
        else:
            words = generated(self.name, body, limit)
            said = [body.get("system") or "", body.get("prompt") or ""]
        model = body.get("model", "scripted")
        prompt = sum(len(text.split()) for text in said)

        def piece(text: str) -> dict[str, Any]:
            if chat:
                return {"message": {"role": "assistant", "content": text}}
            return {"response": text}

        last = {
            "model": model, "created_at": _now(), **piece(""),
            "done_reason": "length", "done": True,
            # /api/generate's token ids of the conversation: here, the words' indexes.
            **({} if chat else {"context": [WORDS.index(w.strip()) for w in words]}),
            "total_duration": 4_000_000, "load_duration": 1_000_000,
            "prompt_eval_count": prompt, "prompt_eval_duration": 1_000_000,
            "eval_count": len(words), "eval_duration": 2_000_000,
        }  # fmt: skip
        if body.get("stream") is False:
            last.update(piece("".join(words)))
            data = json.dumps(last, separators=(",", ":")).encode()
            handler._send(200, data, "application/json; charset=utf-8")  # type: ignore[attr-defined]
            return
        handler.send_response(200)
        handler.send_header("Content-Type", "application/x-ndjson")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        out = handler.wfile

        def line(payload: dict[str, Any]) -> None:
            data = json.dumps(payload, separators=(",", ":")).encode() + b"\n"
            out.write(b"%x\r\n%s\r\n" % (len(data), data))
            out.flush()

        for index, word in enumerate(words):
            if index == self.cut_after:
                handler.close_connection = True
                return  # dies mid-answer: no last line, no end of the chunked body
            if index == self.error_after:
                line({"error": "model runner has unexpectedly stopped"})
                out.write(b"0\r\n\r\n")
                return
            line({"model": model, "created_at": _now(), **piece(word), "done": False})
            time.sleep(self.pause_s)
        line(last)
        out.write(b"0\r\n\r\n")

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
