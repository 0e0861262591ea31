"""Record one session per kind of handoff into recordings/, for replay as a regression suite.

Real llama-servers on the tiny models throughout, except where a real server cannot do
the thing on demand: the in-band error and the tool call come from a scripted upstream
(scripts/testbed/scripted_upstream.py), and the Ollama session from a scripted Ollama
(scripts/testbed/ollama_upstream.py: Ollama cannot run here); recordings/README.md says which is
which.

    .venv/bin/python -m scripts.testbed.record [recordings/] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from mitmproxy import io

from scripts.parts.processes import free_port, running
from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.memfiles import FakeCard
from scripts.testbed.mitm import Mitmdump, watch_sysfs
from scripts.testbed.ollama_upstream import OllamaUpstream
from scripts.testbed.prompts import PROMPT, TOOLS, chat_body
from scripts.testbed.scripted_upstream import (
    STREAM_HEAD,
    FakeUpstream,
    chunked,
    cut_tool_call,
    sse_chunk,
)
from scripts.testbed.tinymodels import ensure_models, reasoning_template

# One client kept open: making one per request costs ~50 ms (its TLS context), long
# enough for a tiny model to finish the answer before the handoff arrives.
CONTROL = httpx.Client()


class Recorder:
    def __init__(self, out: Path, work: Path) -> None:
        self.out = out
        self.work = work
        self.models = ensure_models(work / "models")

    def server(self, model: str = "primary", **kwargs) -> LlamaServer:
        return LlamaServer(self.models[model], log_dir=self.work, **kwargs)

    @contextmanager
    def proxy(
        self, name: str, primary: str, fallbacks: list[str], options=()
    ) -> Iterator[Mitmdump]:
        path = self.out / f"{name}.mitm"
        path.unlink(missing_ok=True)
        # No /health questions: each session shows the kind of handoff it is named for (a
        # dead primary is found by its refused connection, not skipped by routing).
        options = [f"save_stream_file={path}", "spillover_health_s=0", *options]
        mitm = Mitmdump(primary, fallbacks, options=options, log_dir=self.work)
        with running(mitm):
            mitm.servers_known()  # start-up questions first, before the answer
            yield mitm
        print(f"{path}: {path.stat().st_size / 1000:.1f} kB")


def stream(
    proxy: Mitmdump,
    body: dict,
    on_chunk: Callable[[int, int], None] | None = None,
    path: str = "/v1/chat/completions",
) -> None:
    """Stream an answer; `on_chunk(chunks, notes)` after each chunk (an event's data, or
    an NDJSON line): how many chunks came since the last handoff note, and how many notes
    came."""
    chunks = notes = 0
    with httpx.stream("POST", f"{proxy.url}{path}", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith(":"):
                chunks, notes = 0, notes + 1
            elif line.startswith(("data: {", "{")):
                chunks += 1
                if on_chunk is not None:
                    on_chunk(chunks, notes)


def handoff_after(proxy: Mitmdump, *counts: int) -> Callable[[int, int], None]:
    """Ask for a handoff after counts[0] chunks, then counts[1] chunks after that, ..."""

    def on_chunk(chunks: int, notes: int) -> None:
        if notes < len(counts) and chunks == counts[notes]:
            reason = {"reason": "asked for by the recorder"}
            CONTROL.post(f"{proxy.url}/spillover/handoff", json=reason)

    return on_chunk


def no_handoff(rec: Recorder) -> None:
    primary, fallback = rec.server(), rec.server("fallback")
    with running(primary, fallback), rec.proxy("no-handoff", primary.url, [fallback.url]) as p:
        stream(p, chat_body(24))


def requested(rec: Recorder) -> None:
    primary, fallback = rec.server(), rec.server("fallback")
    with running(primary, fallback), rec.proxy("requested", primary.url, [fallback.url]) as p:
        stream(p, chat_body(64), handoff_after(p, 4))


def pressure(rec: Recorder) -> None:
    sysfs = rec.work / "sys"
    card0 = FakeCard(sysfs, "card0", total_mib=16384, used_mib=10000)
    FakeCard(sysfs, "card1", total_mib=8192, used_mib=2000)
    primary, fallback = rec.server(), rec.server("fallback")
    with running(primary, fallback):
        watch = watch_sysfs(sysfs, {primary.url: "drm:card0", fallback.url: "drm:card1"})
        with rec.proxy("pressure", primary.url, [fallback.url], watch) as p:
            stream(p, chat_body(160), lambda n, _: n == 4 and card0.set_used(15041))


def primary_killed(rec: Recorder) -> None:
    primary, fallback = rec.server(), rec.server("fallback")
    with running(primary, fallback), rec.proxy("primary-killed", primary.url, [fallback.url]) as p:
        stream(p, chat_body(64), lambda n, _: n == 4 and primary.kill())


def inband_error(rec: Recorder) -> None:
    error = {"error": {"code": 500, "message": "out of memory", "type": "server_error"}}
    primary = FakeUpstream([(
        STREAM_HEAD + chunked(
            sse_chunk(role=True), sse_chunk(" the"), sse_chunk(" river"),
            b"data: " + json.dumps(error).encode() + b"\n\n",
        ) + b"0\r\n\r\n", 0,
    )])  # fmt: skip
    fallback = rec.server("fallback")
    with running(fallback), rec.proxy("inband-error", primary.url, [fallback.url]) as p:
        stream(p, chat_body(24))
    primary.close()


def before_first_token(rec: Recorder) -> None:
    fallback = rec.server("fallback")
    dead = f"http://127.0.0.1:{free_port()}"
    with running(fallback), rec.proxy("before-first-token", dead, [fallback.url]) as p:
        stream(p, chat_body(24))


def whole_answer(rec: Recorder) -> None:
    """A non-streaming request whose primary is down: answered whole by the fallback."""
    fallback = rec.server("fallback")
    dead = f"http://127.0.0.1:{free_port()}"
    with running(fallback), rec.proxy("whole-answer", dead, [fallback.url]) as p:
        httpx.post(f"{p.url}/v1/chat/completions", json=chat_body(24, stream=False), timeout=60)


def chained_ladder(rec: Recorder) -> None:
    servers = rec.server(), rec.server("fallback"), rec.server("fallback")
    urls = [s.url for s in servers]
    with running(*servers), rec.proxy("chained-ladder", urls[0], urls[1:]) as p:
        stream(p, chat_body(96), handoff_after(p, 4, 4))


def reasoning(rec: Recorder) -> None:
    template = str(reasoning_template(rec.work))
    args = ["--chat-template-file", template, "--ubatch-size", "32"]
    primary, fallback = rec.server(extra_args=args), rec.server(extra_args=args)
    with running(primary, fallback), rec.proxy("reasoning", primary.url, [fallback.url]) as p:
        close = httpx.post(f"{primary.url}/tokenize", json={"content": "</think>"}).json()
        bias = {str(close["tokens"][0]): 12.75}  # closes its reasoning after 33 tokens
        stream(p, chat_body(60, logit_bias=bias), handoff_after(p, 4))


def tool_call(rec: Recorder) -> None:
    """Scripted primary and fallback: the tiny models do not call tools."""
    primary_script, fallback_script = cut_tool_call()
    primary, fallback = FakeUpstream(primary_script), FakeUpstream(fallback_script)
    with rec.proxy("tool-call", primary.url, [fallback.url]) as p:
        stream(p, chat_body(20, tools=TOOLS))
    primary.close()
    fallback.close()


def messages_requested(rec: Recorder) -> None:
    """An Anthropic Messages stream, a handoff asked for mid-answer."""
    primary, fallback = rec.server(), rec.server("fallback")
    body = {"model": "tiny", "max_tokens": 64, "messages": PROMPT, "stream": True}
    with running(primary, fallback), rec.proxy("messages", primary.url, [fallback.url]) as p:
        stream(p, {**body, "temperature": 0}, handoff_after(p, 6), "/v1/messages")


def responses_killed(rec: Recorder) -> None:
    """An OpenAI Responses stream whose primary was SIGKILLed mid-answer."""
    primary, fallback = rec.server(), rec.server("fallback")
    body = {"model": "tiny", "max_output_tokens": 64, "input": PROMPT[0]["content"]}
    with running(primary, fallback), rec.proxy("responses", primary.url, [fallback.url]) as p:
        body |= {"stream": True, "temperature": 0}
        stream(p, body, lambda n, _: n == 8 and primary.kill(), "/v1/responses")


def ollama_cut(rec: Recorder) -> None:
    """Scripted Ollama servers (Ollama cannot run here): the primary dies mid-answer."""
    primary, fallback = OllamaUpstream("primary", cut_after=6), OllamaUpstream("fallback")
    with rec.proxy("ollama", primary.url, [fallback.url]) as p:
        stream(
            p, {"model": "m", "messages": PROMPT, "options": {"num_predict": 24}}, None, "/api/chat"
        )
    primary.close()
    fallback.close()


def ollama_generate_cut(rec: Recorder) -> None:
    """Scripted Ollama servers: a generate stream whose primary dies mid-answer, continued
    as the chat Ollama renders it from."""
    primary, fallback = OllamaUpstream("primary", cut_after=6), OllamaUpstream("fallback")
    with rec.proxy("ollama-generate", primary.url, [fallback.url]) as p:
        body = {"model": "m", "prompt": PROMPT[0]["content"], "options": {"num_predict": 24}}
        stream(p, body, None, "/api/generate")
    primary.close()
    fallback.close()


# Each scenario, and how many handoffs its answer must have had.
SCENARIOS: dict[str, tuple[Callable[[Recorder], None], int]] = {
    "no-handoff": (no_handoff, 0),
    "requested": (requested, 1),
    "pressure": (pressure, 1),
    "primary-killed": (primary_killed, 1),
    "inband-error": (inband_error, 1),
    "before-first-token": (before_first_token, 1),
    "whole-answer": (whole_answer, 1),
    "chained-ladder": (chained_ladder, 2),
    "reasoning": (reasoning, 1),
    "tool-call": (tool_call, 1),
    "messages": (messages_requested, 1),
    "responses": (responses_killed, 1),
    "ollama": (ollama_cut, 1),
    "ollama-generate": (ollama_generate_cut, 1),
}
ATTEMPTS = 5


def handoffs_in(path: Path) -> list[int]:
    with path.open("rb") as f:
        flows = [flow for flow in io.FlowReader(f).stream() if "spillover" in flow.metadata]
    return [len(flow.metadata["spillover"]["handoffs"]) for flow in flows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, nargs="?", default=Path("recordings"))
    parser.add_argument("--only", nargs="*", choices=sorted(SCENARIOS), default=None)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="spillover-record-"))
    recorder = Recorder(args.out.resolve(), work)
    for name, (scenario, handoffs) in SCENARIOS.items():
        if args.only is not None and name not in args.only:
            continue
        # A handoff asked for while the tiny models stream thousands of tokens a second
        # can arrive after the answer ended: then the session is recorded again.
        for _ in range(ATTEMPTS):
            scenario(recorder)
            if handoffs_in(args.out / f"{name}.mitm") == [handoffs]:
                break
        else:
            raise SystemExit(f"{name}: no session with {handoffs} handoffs in {ATTEMPTS} tries")


if __name__ == "__main__":
    main()
