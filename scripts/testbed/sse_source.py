"""A stand-in OpenAI-compatible server that streams llama-server-shaped chunks at a set rate,
for benchmarks: a real llama-server on two cores cannot produce tokens fast enough to find
the proxy's own limit. Each chunk carries its send time (perf_counter_ns, which is
CLOCK_MONOTONIC and so comparable across processes) for per-chunk latency.

    python -m scripts.testbed.sse_source PORT
    POST /v1/chat/completions {"max_tokens": N, "interval_ms": 0}   (0 = as fast as possible)
    POST /v1/messages {"max_tokens": N, "interval_ms": 0}   (the same, as Anthropic Messages events)
    POST /v1/responses {"max_output_tokens": N, "interval_ms": 0}   (as OpenAI Responses events)

Paced streams share one step clock: every open stream's next event is written at the same
tick, back to back, as a GPU server writes a batch's tokens after each decode step.

With "logprobs": true (or llama.cpp's own "n_probs": 1) each chunk carries its token's id,
as llama-server's do (and with
"timings_per_token": true its `timings`); with
"big_event_mib": N the stream's 10th event carries N MiB of text (the big-event benchmark).
It also
answers the questions the addon asks a server at start (/props, /v1/models, /tokenize,
/apply-template),
and `GET /bench/requests` says how many streams it served and how many of them asked for
token ids (so a benchmark can check that each of its rows takes the path it names).
`POST /bench/health-delay {"seconds": S}` makes `GET /health` answer S seconds late, as
vLLM's does when the event loop it shares with its streams is busy; with `"busy": true`
it spends them working on that event loop, as a loaded vLLM's does, not waiting.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import sys
import time

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
BATCH = 64  # events per socket write when unpaced
served = {"streams": 0, "with_ids": 0}
health_delay: dict[str, float | bool] = {"seconds": 0.0, "busy": False}


async def late(seconds: float, busy: bool) -> None:
    if not busy:
        await asyncio.sleep(seconds)
        return
    until = time.monotonic() + seconds
    while time.monotonic() < until:  # the event loop held, as a loaded server's is
        sum(range(1000))


ABOUT = {
    "/props": {"default_generation_settings": {"n_ctx": 65536}},
    "/v1/models": {"data": [{"id": "bench", "meta": {"vocab_type": 1, "n_vocab": 1000}}]},
    "/tokenize": {"tokens": [1, 2, 3]},
}


def chunk(index: int, finish: str | None = None, ids: bool = False, timed: bool = False) -> bytes:
    choice: dict = {
        "finish_reason": finish,
        "index": 0,
        "delta": {} if finish else {"content": f" w{index % 1000}"},
    }
    if ids and not finish:
        text = f" w{index % 1000}"
        entry = {"id": index % 1000, "token": text, "bytes": list(text.encode()), "prob": 1.0}
        choice["logprobs"] = {"content": [{**entry, "top_probs": [entry]}]}
    payload = {
        "choices": [choice],
        "created": 1796000000,
        "id": "chatcmpl-bench",
        "model": "bench",
        "object": "chat.completion.chunk",
        "sent_ns": time.perf_counter_ns(),
    }
    if timed and not finish:  # llama-server's timings_per_token, its fields as it writes them
        payload["timings"] = {
            "cache_n": 0, "prompt_n": 3, "prompt_ms": 1.5, "prompt_per_token_ms": 0.5,
            "prompt_per_second": 2000.0, "predicted_n": index + 1,
            "predicted_ms": 1.5 * (index + 1), "predicted_per_token_ms": 1.5,
            "predicted_per_second": 666.7,
        }  # fmt: skip
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def named_event(kind: str, payload: dict) -> bytes:
    """An event whose type is named on its `event:` line too, as llama-server writes
    Anthropic Messages' and OpenAI Responses' events."""
    data = json.dumps({"type": kind, **payload}, separators=(",", ":")).encode()
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


def message_delta(index: int) -> bytes:
    """One token's text delta, as llama-server's Messages route writes it (plus the stamp)."""
    delta = {"type": "text_delta", "text": f" w{index % 1000}"}
    return named_event(
        "content_block_delta", {"index": 0, "delta": delta, "sent_ns": time.perf_counter_ns()}
    )


MESSAGE = {
    "id": "msg_bench", "type": "message", "role": "assistant", "content": [], "model": "bench",
    "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 3, "output_tokens": 0},
}  # fmt: skip
MESSAGE_HEAD = named_event("message_start", {"message": MESSAGE}) + named_event(
    "content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}
)


def message_tail(count: int) -> bytes:
    stop = {"stop_reason": "max_tokens", "stop_sequence": None}
    return (
        named_event("content_block_stop", {"index": 0})
        + named_event("message_delta", {"delta": stop, "usage": {"output_tokens": count}})
        + named_event("message_stop", {})
    )


RESPONSE = {"id": "resp_bench", "object": "response", "status": "in_progress"}
ITEM_ID = "msg_bench"
ITEM = dict(content=[], id=ITEM_ID, role="assistant", status="in_progress", type="message")
PART = {"type": "output_text", "text": ""}
RESPONSES_HEAD = (
    named_event("response.created", {"response": RESPONSE})
    + named_event("response.in_progress", {"response": RESPONSE})
    + named_event("response.output_item.added", {"item": ITEM})
    + named_event("response.content_part.added", {"item_id": ITEM_ID, "part": PART})
)


def responses_delta(index: int) -> bytes:
    """One token's text delta, as llama-server's Responses route writes it (plus the stamp)."""
    return named_event(
        "response.output_text.delta",
        {"item_id": ITEM_ID, "delta": f" w{index % 1000}", "sent_ns": time.perf_counter_ns()},
    )


def responses_tail(count: int) -> bytes:
    """What llama-server writes once the answer is done: the text whole, its part, its
    item, and the response completed with its usage."""
    text = "".join(f" w{i % 1000}" for i in range(count))
    part = {"type": "output_text", "annotations": [], "logprobs": [], "text": text}
    item = {"type": "message", "status": "completed", "id": ITEM_ID, "content": [part],
            "role": "assistant"}  # fmt: skip
    usage = {"input_tokens": 3, "output_tokens": count, "total_tokens": count + 3,
             "input_tokens_details": {"cached_tokens": 0}}  # fmt: skip
    done = {**RESPONSE, "created_at": 1796000000, "status": "completed", "model": "bench",
            "output": [item], "usage": usage}  # fmt: skip
    return (
        named_event("response.output_text.done", {"item_id": ITEM_ID, "text": text})
        + named_event("response.content_part.done", {"item_id": ITEM_ID, "part": part})
        + named_event("response.output_item.done", {"item": item})
        + named_event("response.completed", {"response": done})
    )


HEADS = {"/v1/messages": MESSAGE_HEAD, "/v1/responses": RESPONSES_HEAD}
DELTAS = {"/v1/messages": message_delta, "/v1/responses": responses_delta}
TAILS = {"/v1/messages": message_tail, "/v1/responses": responses_tail}


def framed(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def send_big_event(writer: asyncio.StreamWriter, mib: int) -> None:
    """Nine ordinary events, then one of `mib` MiB, written a 64 KiB HTTP chunk at a time."""
    writer.write(b"".join(framed(chunk(i)) for i in range(9)))
    head, piece = b'data: {"choices":[{"index":0,"delta":{"content":"', b"x" * 65536
    writer.write(framed(head))
    for _ in range(mib * 16):
        writer.write(framed(piece))
        await writer.drain()
    writer.write(framed(b'"},"finish_reason":null}],"object":"chat.completion.chunk"}\n\n'))


def respond(writer: asyncio.StreamWriter, payload: object) -> None:
    answer = json.dumps(payload).encode()
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(answer), answer))


async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            body = json.loads(await reader.readexactly(length) or b"{}")
            path = head.split(b" ")[1].decode()
            if path == "/apply-template":  # as llama-server renders: a last message left open
                prompt = "".join(str(m.get("content")) for m in body.get("messages") or [])
                respond(writer, {"prompt": prompt})
                continue
            if path == "/bench/health-delay":
                health_delay.update(seconds=float(body["seconds"]), busy=bool(body.get("busy")))
                respond(writer, health_delay)
                continue
            if path == "/health":
                await late(float(health_delay["seconds"]), bool(health_delay["busy"]))
            if path in ABOUT or head.startswith(b"GET"):
                respond(writer, served if path == "/bench/requests" else ABOUT.get(path, "ok"))
                continue
            ids = body.get("logprobs") is True or int(body.get("n_probs") or 0) > 0
            timed = body.get("timings_per_token") is True
            served["streams"] += 1
            served["with_ids"] += ids
            count = int(body.get("max_tokens") or body.get("max_output_tokens") or 1000)
            interval = float(body.get("interval_ms", 0)) / 1000
            writer.write(HEAD)
            if path in HEADS:
                writer.write(framed(HEADS[path]))
            event = DELTAS.get(path) or functools.partial(chunk, ids=ids, timed=timed)
            if big := int(body.get("big_event_mib", 0)):
                await send_big_event(writer, big)
            if interval:
                # On one clock for every stream, as a batched decode step writes all its
                # sequences' tokens at once; a late event does not delay the next.
                start = math.ceil(time.monotonic() / interval) * interval
                for i in range(count):
                    await asyncio.sleep(max(0.0, start + i * interval - time.monotonic()))
                    writer.write(framed(event(i)))
                    await writer.drain()
            else:
                for start in range(0, count, BATCH):
                    end = min(count, start + BATCH)
                    # One HTTP chunk per event, as llama-server sends them.
                    writer.write(b"".join(framed(event(i)) for i in range(start, end)))
                    await writer.drain()
            if path in TAILS:
                tail = TAILS[path](count)
            else:
                tail = chunk(count, finish="length") + b"data: [DONE]\n\n"
            writer.write(framed(tail) + b"0\r\n\r\n")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def main(port: int) -> None:
    server = await asyncio.start_server(serve, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
