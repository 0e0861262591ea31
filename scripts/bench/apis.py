"""Benchmark: each API the addon carries, side by side in one run.

For chat completions, Anthropic Messages and OpenAI Responses against real llama-servers
(tiny models), and Ollama chat against the scripted Ollama (scripts/testbed/ollama_upstream.py:
Ollama cannot run here, so its rows time the proxies only), through three routes
(direct, plain mitmdump streaming, mitmdump with the addon): the time to the first text
event and the time for a whole answer (medians, one kept-alive client per route, routes
interleaved), then the pause a client sees at an asked-for handoff (last text before ->
first text after), with the addon's rows over direct as ratios.

    .venv/bin/python -m scripts.bench.apis [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from scripts.parts.processes import running
from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.mitm import Mitmdump
from scripts.testbed.ollama_upstream import OllamaUpstream
from scripts.testbed.prompts import PROMPT
from scripts.testbed.tinymodels import ensure_models

QUESTION = PROMPT[0]["content"]


def request(api: str, tokens: int) -> tuple[str, dict]:
    """The path and body of a streamed, greedy answer of `tokens` tokens."""
    if api == "chat":
        body = {"messages": PROMPT, "max_tokens": tokens}
        return "/v1/chat/completions", body | {"stream": True, "temperature": 0}
    if api == "messages":
        body = {"model": "m", "messages": PROMPT, "max_tokens": tokens}
        return "/v1/messages", body | {"stream": True, "temperature": 0}
    if api == "responses":
        body = {"model": "m", "input": QUESTION, "max_output_tokens": tokens}
        return "/v1/responses", body | {"stream": True, "temperature": 0}
    return "/api/chat", {"model": "m", "messages": PROMPT, "options": {"num_predict": tokens}}


def has_text(api: str, line: str) -> bool:
    marker = {
        "chat": '"content":"', "messages": '"text_delta"', "responses": "output_text.delta",
        "ollama": '"done":false',
    }[api]  # fmt: skip
    return marker in line and not line.startswith(":")


def timed(client: httpx.Client, url: str, api: str, tokens: int, on_text=None, extra=None):
    """(ms to the first text, ms to the end, text gaps in ms) of one answer; `extra`: more
    fields of the request (a model name an engine holds clients to)."""
    path, body = request(api, tokens)
    body |= extra or {}
    start = time.perf_counter()
    texts: list[float] = []
    with client.stream("POST", url + path, json=body, timeout=60) as reply:
        for line in reply.iter_lines():
            if has_text(api, line):
                texts.append(time.perf_counter())
                if on_text is not None:
                    on_text(len(texts))
    end = time.perf_counter()
    gaps = [(b - a) * 1000 for a, b in itertools.pairwise(texts)]
    return (texts[0] - start) * 1000, (end - start) * 1000, gaps


def side_by_side(
    api: str, urls: dict[str, str], repeats: int, tokens: int, extra=None, label: str = ""
) -> None:
    clients = {name: httpx.Client() for name in urls}
    for name, url in urls.items():
        # warm up: connections, the prompt cache
        timed(clients[name], url, api, tokens, extra=extra)
    first: dict[str, list[float]] = {name: [] for name in urls}
    whole: dict[str, list[float]] = {name: [] for name in urls}
    for _ in range(repeats):
        for name, url in urls.items():
            a, b, _ = timed(clients[name], url, api, tokens, extra=extra)
            first[name].append(a)
            whole[name].append(b)
    direct_first = statistics.median(first["direct"])
    direct_whole = statistics.median(whole["direct"])
    for name in urls:
        f, w = statistics.median(first[name]), statistics.median(whole[name])
        print(
            f"{label or api:10}{name:16}{f:12.2f}{f - direct_first:+12.2f}"
            f"{w:12.1f}{w / direct_whole:11.2f}x"
        )


def pause(api: str, proxy: Mitmdump, tokens: int, extra=None) -> float:
    """The gap a handoff asked for at the client's 20th text event leaves in the stream
    (the longest gap after it: tokens come a millisecond apart or less here)."""
    control = httpx.Client()

    def on_text(n: int) -> None:
        if n == 20:
            control.post(f"{proxy.url}/spillover/handoff", json={})

    _, _, gaps = timed(httpx.Client(), proxy.url, api, tokens, on_text, extra)
    return max(gaps[19:])


def command_line(doc: str, name: str) -> tuple[int, int, Path]:
    """(answers per row, tokens per answer, a working folder) for a side-by-side bench."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args()
    repeats, tokens = (10, 128) if args.quick else (30, 256)
    return repeats, tokens, Path(tempfile.mkdtemp(prefix=f"spillover-bench-{name}-"))


def main() -> None:
    repeats, tokens, work = command_line(__doc__, "apis")
    models = ensure_models(work / "models")
    primary = LlamaServer(models["primary"], log_dir=work)
    fallback = LlamaServer(models["fallback"], log_dir=work)
    with running(primary, fallback):
        plain = Mitmdump(primary.url, addon=False, log_dir=work)
        addon = Mitmdump(primary.url, [fallback.url], log_dir=work)
        with running(plain, addon):
            addon.servers_known()
            urls = {"direct": primary.url, "plain mitmdump": plain.url, "addon": addon.url}
            print(f"{repeats} answers of {tokens} tokens per row, medians")
            print(f"{'api':10}{'route':16}{'first ms':>12}{'over direct':>12}"
                  f"{'whole ms':>12}{'ratio':>12}")  # fmt: skip
            for api in ("chat", "messages", "responses"):
                side_by_side(api, urls, repeats, tokens)
            pauses = {api: pause(api, addon, 600) for api in ("chat", "messages", "responses")}
    ollama, spare = OllamaUpstream("primary", pause_s=0.002), OllamaUpstream("fallback")
    plain = Mitmdump(ollama.url, addon=False, log_dir=work)
    plain.health_path = "/"  # Ollama has no /health; its root says it is running
    addon = Mitmdump(ollama.url, [spare.url], log_dir=work)
    with running(plain, addon):
        urls = {"direct": ollama.url, "plain mitmdump": plain.url, "addon": addon.url}
        side_by_side("ollama", urls, repeats, tokens)
        pauses["ollama"] = pause("ollama", addon, 200)
    print("\nhandoff pause a client sees (gap around the cut), ms")
    print(json.dumps({api: round(ms, 1) for api, ms in pauses.items()}))


if __name__ == "__main__":
    main()
