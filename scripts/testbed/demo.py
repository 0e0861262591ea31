"""Live demo: two real llama-servers on tiny models, mitmdump with the addon, two handoffs.

1. Mid-answer, another process "loads" onto the primary's card: +5,041 MiB written into
   a sysfs tree of real files that the addon's memory watcher reads (this machine may
   have no GPU). The watcher sees the step and the answer moves to the fallback.
2. The card is freed again; once it has stayed clear (the dwell, 2 s here) the primary
   takes the next answer, and is SIGKILLed mid-answer; the fallback finishes it.

Text from the primary prints in the terminal's colour, text from the fallback in cyan;
the handoff note the addon puts into the stream prints in yellow, and each part ends with
a line saying where the answer moved, after how many tokens, the pause and how many
tokens each server wrote. The working folder (models, logs) is removed at the end unless
--keep.

    scripts/demo.sh            # or: .venv/bin/python -m scripts.testbed.demo [--keep] [--fast]
"""

from __future__ import annotations

import argparse
import json
import queue
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from scripts.parts.processes import running
from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.memfiles import FakeCard
from scripts.testbed.mitm import Mitmdump, watch_sysfs
from scripts.testbed.tinymodels import ensure_models

CYAN, YELLOW, DIM, RESET = "\033[36m", "\033[33m", "\033[2m", "\033[0m"
PROMPT = "Tell me a long story about the river, the bridge and the mountain."
TOKENS = 600
PRINT_DELAY = 0.004  # seconds per token on screen; the servers run at full speed
AFTER = 300  # the client's tokens before each part's event
DWELL_S = 2  # how long the card stays clear before the primary takes new answers again


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
                    chunk = json.loads(line[6:])
                    events.put(("chunk", chunk))
                    # Tokens, not chunks: the first chunk carries the role alone.
                    said = any(
                        (c.get("delta") or {}).get("content") for c in chunk.get("choices") or ()
                    )
                    received += said
                    if said and received == after:
                        threading.Thread(target=action).start()
        events.put(("end", None))

    threading.Thread(target=read, daemon=True).start()
    return events


def show(events: queue.Queue, primary_model: str, delay: float) -> dict[str, int]:
    """Print the answer as it arrives; the tokens each server wrote, from its usage."""
    legs: dict[str, int] = {}
    while True:
        kind, item = events.get()
        if kind == "end":
            return legs
        if kind == "note":
            print(f"\n{YELLOW}[{item}]{RESET}\n", flush=True)
            continue
        if item.get("usage"):
            for leg in item["usage"].get("spillover", {}).get("legs", []):
                name = Path(leg["model"]).stem
                legs[name] = legs.get(name, 0) + leg["completion_tokens"]
        for choice in item.get("choices") or ():
            text = (choice.get("delta") or {}).get("content") or ""
            colour = "" if item.get("model") == primary_model else CYAN
            sys.stdout.write(f"{colour}{text}{RESET}")
            sys.stdout.flush()
            time.sleep(delay)
            if choice.get("finish_reason"):
                print(f"\n{DIM}finish_reason: {choice['finish_reason']}{RESET}")


def summary(proxy: Mitmdump, legs: dict[str, int], seen: int) -> str:
    """One line: where the part's answer moved, when, the pause, who wrote what."""
    status = httpx.get(f"{proxy.url}/spillover/status").json()
    handoffs = status["recent_handoffs"][seen:]
    if not handoffs:
        return f"no handoff; tokens: {legs}"
    (handoff,) = handoffs
    within = handoff.get("detected_within_ms")
    seen_in = f", seen within {within:.0f} ms" if within is not None else ""
    wrote = ", ".join(f"{tokens} from the {name}" for name, tokens in legs.items())
    paused = handoff.get("pause_ms")
    waited = f"the client waited {paused:.1f} ms" if paused is not None else "nothing came after"
    return (
        f"{handoff['kind']} handoff after {handoff['at_token']} tokens{seen_in}; {waited}; {wrote}"
    )


def wait_until_ok(proxy: Mitmdump, server: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        routing = httpx.get(f"{proxy.url}/spillover/status").json()["routing"]["states"]
        if routing.get(server, {}).get("state") == "ok":
            return
        time.sleep(0.1)
    raise SystemExit(f"{server} did not come back: {routing}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="keep the working folder")
    parser.add_argument("--fast", action="store_true", help="print tokens as they arrive")
    args = parser.parse_args()
    delay = 0 if args.fast else PRINT_DELAY
    work = Path(tempfile.mkdtemp(prefix="spillover-demo-"))
    try:
        demo(work, delay)
    finally:
        if args.keep:
            print(f"\n{DIM}models and logs kept in {work}{RESET}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def demo(work: Path, delay: float) -> None:
    models = ensure_models(work / "models")
    primary = LlamaServer(models["primary"], log_dir=work)
    fallback = LlamaServer(models["fallback"], log_dir=work)
    print(f"{DIM}starting llama-server x2 (tiny models, CPU) and mitmdump with the addon{RESET}")
    sysfs = work / "sys"
    card = FakeCard(sysfs, "card0", total_mib=16384, used_mib=10000)
    FakeCard(sysfs, "card1", total_mib=8192, used_mib=1500)
    with running(primary, fallback):
        cards = {primary.url: "drm:card0", fallback.url: "drm:card1"}
        options = [*watch_sysfs(sysfs, cards), f"spillover_dwell_s={DWELL_S}"]
        proxy = Mitmdump(primary.url, [fallback.url], options=options, log_dir=work)
        # Generous: on a 2-core machine busy with other work, mitmdump took 7 s to load
        # the addon and over 20 s more to answer its health.
        with running(proxy, timeout=120):
            proxy.servers_known()
            print(
                f"primary {primary.url} on card0, fallback {fallback.url} on card1, "
                f"proxy {proxy.url}\n"
            )
            model = str(models["primary"])

            print(f"{YELLOW}== 1. another process takes 5 GB of the primary's card =={RESET}")
            print(
                f"{DIM}card0 (a sysfs tree of real files standing in for a GPU): 10,000 of "
                f"16,384 MiB used; the step is written once the client has {AFTER} tokens "
                f"(the server is ahead of the client by then, and the watcher takes a few "
                f"ms to see it: the handoff comes some tokens later){RESET}"
            )
            legs = show(
                stream(proxy, after=AFTER, action=lambda: card.set_used(15041)), model, delay
            )
            print(f"{YELLOW}-> {summary(proxy, legs, 0)}{RESET}")

            print(f"\n{YELLOW}== 2. the primary llama-server is SIGKILLed mid-answer =={RESET}")
            card.set_used(10000)
            print(f"{DIM}card0 freed; waiting {DWELL_S} s for it to stay clear{RESET}")
            wait_until_ok(proxy, primary.url)
            legs = show(stream(proxy, after=AFTER, action=primary.kill), model, delay)
            print(f"{YELLOW}-> {summary(proxy, legs, 1)}{RESET}")


if __name__ == "__main__":
    main()
