"""A scripted OpenAI-compatible chat server that the addon cannot prove: only
`/v1/chat/completions` and `/v1/models` (owned by "organization-owner", as a hosted API
says), no engine routes. It stands in for what no real server here does on demand: echo
a partial answer, start it over, or refuse it with a 400, each as hosted APIs and
gateways do. Its "model" writes one word per token, chosen by a hash of everything
before it (scripts/testbed/ollama_upstream.py), so its continuation of a partial answer
is a pure function of that text.

Modes for a chat that ends in an assistant message: "continue" (goes on from it),
"echo" (repeats it first, then goes on), "restart" (reads the chat without it: the
answer from its start again), "refuse" (HTTP 400, as a model that takes no prefill),
"surrogate" (goes on, the seventh word of a streamed answer ending in half of a UTF-16
pair, as a server that splits an emoji's escape across chunks sends it). With `calls`, a
streamed chat that offers tools and ends in an assistant message is answered, after any
echo, by a call of the first tool straight away, as OpenAI streams one (its id and name
first, its arguments a few characters a chunk, then finish_reason "tool_calls"): what an
agent's model writes after "Let me look that up.".
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from scripts.testbed.ollama_upstream import answer

REFUSAL = "This model does not support assistant message prefill."
MODEL = "hosted-model"
HALF_PAIR_AT = 6
ARGUMENT_PIECE = 4  # characters of a call's arguments a chunk


def call_arguments(tool: dict[str, Any]) -> str:
    """The arguments the stand-in calls `tool` with: each required property's first enum
    value (its name where it has none)."""
    properties = (tool.get("parameters") or {}).get("properties") or {}
    required = (tool.get("parameters") or {}).get("required") or []
    return json.dumps({name: (properties[name].get("enum") or [name])[0] for name in required})


def own_words(name: str, messages: list[dict[str, Any]], mode: str, tokens: int) -> list[str]:
    """What the server writes for `messages` in `mode` (see the module's text)."""
    prefill = messages[-1].get("content") or "" if messages[-1].get("role") == "assistant" else ""
    if prefill and mode == "restart":
        return answer(name, messages[:-1], tokens)
    words = answer(name, messages, tokens)
    return [prefill, *words] if prefill and mode == "echo" else words


class OpenAIUpstream:
    def __init__(
        self,
        name: str,
        mode: str = "continue",
        pause_s: float = 0.0,
        cut_after: int | None = None,
        port: int = 0,
        calls: bool = False,
    ) -> None:
        """`cut_after`: a streamed answer's connection closes after that many words (a
        server that died mid-answer); `port`: one to listen on (another run's, say);
        `calls`: a continuation offered tools is a call (see the module's text)."""
        self.name, self.mode, self.pause_s, self.cut_after = name, mode, pause_s, cut_after
        self.calls = calls
        self.requests: list[dict[str, Any]] = []
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def handle(self) -> None:
                with contextlib.suppress(ConnectionError):
                    super().handle()

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    models = {"object": "list", "data": [
                        {"id": MODEL, "object": "model", "owned_by": "organization-owner"}
                    ]}  # fmt: skip
                    self._json(200, models)
                else:
                    self._json(404, {"error": {"message": "not found"}})

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                if self.path != "/v1/chat/completions":
                    self._json(404, {"error": {"message": "not found"}})
                    return
                upstream.requests.append(body)
                upstream._answer(self, body)

            def _json(self, status: int, payload: Any) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                # No connection outlives its answer: closed, the server is gone at once.
                self.send_header("Connection", "close")
                self.close_connection = True
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def words(self, messages: list[dict[str, Any]], tokens: int) -> list[str]:
        return own_words(self.name, messages, self.mode, tokens)

    def _answer(self, handler: Any, body: dict[str, Any]) -> None:
        messages = body.get("messages") or [{}]
        if self.mode == "refuse" and messages[-1].get("role") == "assistant":
            handler._json(400, {"error": {"message": REFUSAL, "type": "invalid_request_error"}})
            return
        words = self.words(messages, int(body.get("max_tokens") or 16))
        envelope = {"id": "chatcmpl-1", "created": 1, "model": MODEL}
        if not body.get("stream"):
            message = {"role": "assistant", "content": "".join(words)}
            choice = {"index": 0, "message": message, "finish_reason": "length"}
            usage = {"prompt_tokens": 10, "completion_tokens": len(words), "total_tokens": 0}
            handler._json(200, {**envelope, "object": "chat.completion", "choices": [choice],
                                "usage": usage})  # fmt: skip
            return
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()

        def event(delta: dict[str, Any], finish: str | None = None) -> None:
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            chunk = {**envelope, "object": "chat.completion.chunk", "choices": [choice]}
            data = b"data: " + json.dumps(chunk).encode() + b"\n\n"
            handler.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            handler.wfile.flush()

        if self.mode == "surrogate" and len(words) > HALF_PAIR_AT:
            words[HALF_PAIR_AT] += "\ud83d"
        if self.calls and body.get("tools") and messages[-1].get("role") == "assistant":
            echoed = words[:1] if self.mode == "echo" else []
            self._call(handler, event, echoed, body["tools"][0]["function"])
            return
        event({"role": "assistant", "content": ""})
        for index, word in enumerate(words):
            if index == self.cut_after:
                handler.close_connection = True
                return
            event({"content": word})
            time.sleep(self.pause_s)
        event({}, "length")
        done = b"data: [DONE]\n\n"
        handler.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))

    def _call(self, handler: Any, event: Any, echoed: list[str], tool: dict[str, Any]) -> None:
        """`echoed` words, then a whole call of `tool`, and the stream's end."""
        event({"role": "assistant", "content": None})
        for word in echoed:
            event({"content": word})
        arguments = call_arguments(tool)
        head = {"index": 0, "id": "call_1", "type": "function",
                "function": {"name": tool["name"], "arguments": ""}}  # fmt: skip
        event({"tool_calls": [head]})
        for at in range(0, len(arguments), ARGUMENT_PIECE):
            piece = arguments[at : at + ARGUMENT_PIECE]
            event({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
        event({}, "tool_calls")
        done = b"data: [DONE]\n\n"
        handler.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
