"""A scripted HTTP upstream, for what a real llama-server cannot do on demand: an in-band
error event, a 503 before any byte, garbage bytes, a stall, a tool call from a tiny model.
Each test and recording that uses it says so."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

Script = list[tuple[bytes, float]]  # what to send, and how long to wait after it


def sse_chunk(content: str | None = None, finish: str | None = None, role: bool = False) -> bytes:
    delta: dict[str, Any] = {"role": "assistant", "content": None} if role else {}
    if content is not None:
        delta["content"] = content
    chunk = {
        "id": "chatcmpl-fake",
        "created": 1,
        "model": "fake",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    # Raw UTF-8, as llama-server writes it.
    return b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n"


def tool_piece(index: int, arguments: str, name: str | None = None) -> bytes:
    """A chunk carrying one piece of a streamed tool call, as llama-server sends them."""
    piece: dict[str, Any] = {"index": index, "function": {"arguments": arguments}}
    if name is not None:
        piece |= {"id": f"call-{index}", "type": "function"}
        piece["function"]["name"] = name
    choice = {"index": 0, "delta": {"tool_calls": [piece]}, "finish_reason": None}
    chunk = {"id": "c", "created": 1, "model": "fake", "choices": [choice]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts if p)


def cut_tool_call() -> tuple[Script, Script]:
    """A primary that dies inside a tool call's arguments, and a fallback that writes its
    own call whole: scripts for the two FakeUpstreams."""
    cut = chunked(sse_chunk(role=True), sse_chunk(" ok"), tool_piece(0, '{"a"', name="f"))
    whole = chunked(
        sse_chunk(role=True), tool_piece(0, '{"a": ', name="g"), tool_piece(0, "2}"),
        sse_chunk(finish="tool_calls"), b"data: [DONE]\n\n",
    )  # fmt: skip
    return [(STREAM_HEAD + cut, 0.2)], [(STREAM_HEAD + whole + b"0\r\n\r\n", 0)]


STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


NOT_FOUND = b"HTTP/1.1 404 Not Found\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"
# It stands in for llama-server: its model list says so, and it renders a chat as the
# tiny models' ChatML template does, a trailing assistant message left open (what the
# addon checks before it lets a server continue an answer: addon/servers/proof.py).
MODELS = {"object": "list", "data": [{"id": "scripted", "object": "model", "owned_by": "llamacpp"}]}


def chatml(messages: list[dict[str, Any]]) -> str:
    turns = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
    if messages and messages[-1]["role"] == "assistant":
        return "".join(turns[:-1]) + f"<|im_start|>assistant\n{messages[-1]['content']}"
    return "".join(turns) + "<|im_start|>assistant\n"


def json_response(payload: Any) -> bytes:
    data = json.dumps(payload).encode()
    head = (
        "HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-type: application/json\r\n"
        f"content-length: {len(data)}"
    )
    return head.encode() + b"\r\n\r\n" + data


class FakeUpstream:
    """Answers every POST with `script`: (bytes, seconds to wait after sending) pairs,
    then closes the connection; `/health`, `/v1/models` and `/apply-template` as
    llama-server does (see MODELS). Anything else (the addon's other start-up
    questions) gets 404."""

    def __init__(
        self, script: Sequence[tuple[bytes, float]], later: Sequence[tuple[bytes, float]] = ()
    ) -> None:
        """`script` answers the first request; `later`, when given, every one after it."""
        self.script = list(script)
        self.later = list(later)
        self.requests: list[bytes] = []
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                if not (more := conn.recv(65536)):
                    return  # the client closed before its request was whole (a probe)
                data += more
            head, _, body = data.partition(b"\r\n\r\n")
            length = next(
                (
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                ),
                0,
            )
            while len(body) < length:
                if not (more := conn.recv(65536)):
                    return
                body += more
            if head.startswith(b"GET /health "):
                conn.sendall(json_response({"status": "ok"}))
                return
            if head.startswith(b"GET /v1/models "):
                conn.sendall(json_response(MODELS))
                return
            if head.startswith(b"POST /apply-template "):
                conn.sendall(json_response({"prompt": chatml(json.loads(body)["messages"])}))
                return
            if head.startswith(b"POST /tokenize "):  # a character a token, no special ones
                text = json.loads(body)["content"]
                conn.sendall(json_response({"tokens": [{"id": ord(c), "piece": c} for c in text]}))
                return
            if not head.startswith(b"POST "):
                conn.sendall(NOT_FOUND)
                return
            self.requests.append(body)
            script = self.later if self.later and len(self.requests) > 1 else self.script
            try:
                for part, pause in script:
                    conn.sendall(part)
                    time.sleep(pause)
            except OSError:
                pass

    def close(self) -> None:
        self._sock.close()
