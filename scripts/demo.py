"""Live demo: two real llama-servers on tiny models, mitmdump with the addon, two handoffs.

1. Mid-answer, another process "loads" onto the primary's card: +5,041 MiB written into
   a sysfs tree of real files that the addon's memory watcher reads (this machine may
   have no GPU). The watcher sees the step and the answer moves to the fallback.
2. The primary llama-server is SIGKILLed mid-answer; the fallback finishes the answer.

Text from the primary prints in the terminal's colour, text from the fallback in cyan;
the handoff note the addon puts into the stream prints in yellow.

    scripts/demo.sh            # or: .venv/bin/python -m scripts.demo
"""

from __future__ import annotations

import json
import queue
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.memfiles import FakeCard
from scripts.testbed.mitm import Mitmdump, watch_sysfs
from scripts.testbed.processes import running
from scripts.testbed.tinymodels import ensure_models

CYAN, YELLOW, DIM, RESET = "\033[36m", "\033[33m", "\033[2m", "\033[0m"
PROMPT = "Tell me a long story about the river, the bridge and the mountain."
TOKENS = 600
PRINT_DELAY = 0.004  # seconds per token on screen; the servers run at full speed


def stream(proxy: Mitmdump, after: int, action: Callable[[], None]) -> queue.Queue:
    """Read the SSE stream in a thread; run `action` once `after` tokens have arrived."""
    events: queue.Queue = queue.Queue()
    body = {
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    def read() -> None:
        received = 0
        with httpx.stream("POST", f"{proxy.url}/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith(":"):
                    events.put(("note", line.lstrip(": ")))
                elif line.startswith("data: ") and line != "data: [DONE]":
                    events.put(("chunk", json.loads(line[6:])))
                    received += 1
                    if received == after:
                        threading.Thread(target=action).start()
        events.put(("end", None))

    threading.Thread(target=read, daemon=True).start()
    return events


def show(events: queue.Queue, primary_model: str) -> None:
    while True:
        kind, item = events.get()
        if kind == "end":
            break
        if kind == "note":
            print(f"\n{YELLOW}[{item}]{RESET}\n", flush=True)
            continue
        if item.get("usage"):
            usage = item["usage"]
            legs = usage.get("spillover", {}).get("legs", [])
            print(f"\n\n{DIM}usage: {usage['completion_tokens']} tokens", end="")
            for leg in legs:
                print(f"; {leg['completion_tokens']} from {Path(leg['model']).name}", end="")
            print(RESET)
        for choice in item.get("choices") or ():
            text = (choice.get("delta") or {}).get("content") or ""
            colour = "" if item.get("model") == primary_model else CYAN
            sys.stdout.write(f"{colour}{text}{RESET}")
            sys.stdout.flush()
            time.sleep(PRINT_DELAY)
            if choice.get("finish_reason"):
                print(f"\n{DIM}finish_reason: {choice['finish_reason']}{RESET}")


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="spillover-demo-"))
    models = ensure_models(work / "models")
    primary = LlamaServer(models["primary"], log_dir=work)
    fallback = LlamaServer(models["fallback"], log_dir=work)
    print(f"{DIM}starting llama-server x2 (tiny models, CPU) and mitmdump with the addon{RESET}")
    sysfs = work / "sys"
    card = FakeCard(sysfs, "card0", total_mib=16384, used_mib=10000)
    FakeCard(sysfs, "card1", total_mib=8192, used_mib=1500)
    with running(primary, fallback):
        cards = {primary.url: "drm:card0", fallback.url: "drm:card1"}
        proxy = Mitmdump(
            primary.url, [fallback.url], options=watch_sysfs(sysfs, cards), log_dir=work
        )
        with running(proxy):
            print(
                f"primary {primary.url} on card0, fallback {fallback.url} on card1, "
                f"proxy {proxy.url}\n"
            )
            model = str(models["primary"])

            print(f"{YELLOW}== 1. another process takes 5 GB of the primary's card =={RESET}")
            print(
                f"{DIM}card0 (a sysfs tree of real files standing in for a GPU): 10,000 of "
                f"16,384 MiB used; the step is written after 300 tokens{RESET}"
            )
            show(stream(proxy, after=300, action=lambda: card.set_used(15041)), model)

            print(f"\n{YELLOW}== 2. the primary llama-server is SIGKILLed mid-answer =={RESET}")
            show(stream(proxy, after=300, action=primary.kill), model)
            print(f"\n{DIM}logs: {work}{RESET}")


if __name__ == "__main__":
    main()
