"""Benchmark: what shadow prefill saves at a handoff, and what it costs the fallback.

Real llama-servers on a generated "medium" model (6 x 384, same vocabulary as the test
models; reading a prompt takes visible time on a CPU), the same model on both sides so
the continuation replays token ids. Side by side in one run, at prompts of about 512,
2,048 and 7,000 tokens:

- the pause at a handoff (the proxy's own measure, from its decision to the next leg's
  first byte, as its log says) and the silence a client sees (its last text from the
  primary -> the first from the fallback) with no shadow and with shadows updated every
  32, 8 and 1 tokens, next to one decode step of the fallback; the tokens the fallback
  read at the handoff, and the extra tokens the shadow made it read over the answer;
- the fallback's throughput for another client streaming on it, with and without a
  shadowed answer beside it, for a fallback running the same model and one running a
  smaller (4 x 256) model.

Each handoff comes while the primary streams on (it is not held), once the shadow is in
its steady state. The fallback's cache is erased before each run, so "no shadow" is a
cold prefill.

    .venv/bin/python -m scripts.bench.shadow [--quick] [--part pauses|throughput]
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from scripts.parts.processes import running
from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.mitm import Mitmdump
from scripts.testbed.tinymodels import BENCH_PRESETS, PRESETS, ensure_model

CONTROL = httpx.Client(timeout=60)
CONTEXTS = (512, 2048, 7000)
ANSWER = 1500  # long enough that the answer still streams when a 7,000-token shadow caught up
CUT = 48  # chunks before the handoff is asked for (once the shadow has caught up)
SETUPS = {"no shadow": ["spillover_shadow=off"]} | {
    f"shadow every {n}": ["spillover_shadow=always", f"spillover_shadow_every={n}"]
    for n in (32, 8, 1)
}
FIRST_BYTE = re.compile(r"first byte after ([0-9.]+) ms")  # the handoff's line in the log
QUIET = ["spillover_stall_s=0", "spillover_slow_percent=0", "spillover_health_s=0"]


def prompt_of(tokens: int, server: LlamaServer) -> str:
    """A user message whose rendered chat prompt is about `tokens` tokens long."""
    words = 100
    for _ in range(8):
        text = " ".join(f"river{i % 97} stone" for i in range(words))
        rendered = CONTROL.post(
            f"{server.url}/apply-template", json={"messages": [{"role": "user", "content": text}]}
        ).json()["prompt"]
        count = len(
            CONTROL.post(f"{server.url}/tokenize", json={"content": rendered}).json()["tokens"]
        )
        if abs(count - tokens) <= tokens * 0.02:
            break
        words = max(1, round(words * tokens / count))
    return text


def body(text: str, max_tokens: int = ANSWER) -> dict:
    return {
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }


def erase(server: LlamaServer) -> None:
    for slot in CONTROL.get(f"{server.url}/slots").json():
        CONTROL.post(f"{server.url}/slots/{slot['id']}?action=erase").raise_for_status()


def caught_up(proxy: Mitmdump, timeout: float = 120) -> None:
    """Wait for the shadow's steady state: its first update read the prompt, the second
    what was written meanwhile, from the third on it follows the answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        live = CONTROL.get(f"{proxy.url}/spillover/status").json()["live"]
        shadow = live[0]["shadow"] if live else None
        if shadow and shadow["updates"] >= 3:
            return
        time.sleep(0.005)
    raise RuntimeError("the shadow never caught up")


def one_handoff(proxy: Mitmdump, text: str, every: int | None) -> dict:
    """Stream, hand off after CUT chunks (with a shadow: once it has caught up)."""
    note_at = first_after = last_before = None
    chunks, shadow, timings = 0, None, {}
    with httpx.stream(
        "POST", f"{proxy.url}/v1/chat/completions", json=body(text), timeout=300
    ) as r:
        for line in r.iter_lines():
            if line.startswith(": spillover: handoff"):
                note_at = time.perf_counter()
            elif line.startswith("data: {"):
                chunks += 1
                if '"content"' in line and note_at is None:
                    last_before = time.perf_counter()
                if note_at is not None and first_after is None and '"content"' in line:
                    first_after = time.perf_counter()
                if '"timings"' in line:
                    timings = httpx.Response(200, content=line[6:]).json()["timings"]
                if chunks == CUT:
                    if every is not None:
                        caught_up(proxy)
                        live = CONTROL.get(f"{proxy.url}/spillover/status").json()["live"]
                        shadow = live[0]["shadow"]
                    CONTROL.post(f"{proxy.url}/spillover/handoff")
    paused = FIRST_BYTE.findall(proxy.log_path.read_text(errors="replace"))
    if note_at is None or first_after is None or last_before is None or not paused:
        raise RuntimeError("no handoff happened")
    return {
        "pause_ms": float(paused[-1]),
        "silence_ms": (first_after - last_before) * 1000,
        "read_at_handoff": timings.get("prompt_n"),
        "extra": None if shadow is None else shadow["computed_tokens"],
        "decode_ms": timings.get("predicted_per_token_ms"),
    }


def pauses(primary: LlamaServer, fallback: LlamaServer, repeats: int, work: Path) -> None:
    proxies = {
        name: Mitmdump(primary.url, [fallback.url], options=[*options, *QUIET], log_dir=work)
        for name, options in SETUPS.items()
    }
    with running(*proxies.values()):
        for proxy in proxies.values():
            proxy.servers_known()
        print(f"{'context':>8} {'setup':16} {'pause ms':>9} {'silence ms':>11} "
              f"{'decode ms':>10} {'read at cut':>12} {'shadow read':>12}")  # fmt: skip
        for context in CONTEXTS:
            text = prompt_of(context, primary)
            for name, proxy in proxies.items():
                every = None if name == "no shadow" else int(name.rsplit(" ", 1)[1])
                runs = []
                for _ in range(repeats):
                    erase(fallback)
                    runs.append(one_handoff(proxy, text, every))
                pause = statistics.median(r["pause_ms"] for r in runs)
                silence = statistics.median(r["silence_ms"] for r in runs)
                decode = statistics.median(r["decode_ms"] or 0 for r in runs)
                read = statistics.median(r["read_at_handoff"] or 0 for r in runs)
                extra = (
                    "" if every is None else f"{statistics.median(r['extra'] for r in runs):,.0f}"
                )
                print(
                    f"{context:8,} {name:16} {pause:9.1f} {silence:11.1f} {decode:10.2f} "
                    f"{read:12,.0f} {extra:>12}"
                )


def other_client_rate(fallback: LlamaServer, proxy: Mitmdump | None, text: str) -> float:
    """Tokens/s of a client streaming on the fallback directly, while (with `proxy`) a
    shadowed answer streams through the proxy beside it."""
    result: list[float] = []

    def other() -> None:
        start, tokens = time.perf_counter(), 0
        request = body("Tell me about the river.", 1500)
        with httpx.stream(
            "POST", f"{fallback.url}/v1/chat/completions", json=request, timeout=300
        ) as r:
            for line in r.iter_lines():
                tokens += line.startswith("data: {")
        result.append(tokens / (time.perf_counter() - start))

    thread = threading.Thread(target=other)
    thread.start()
    if proxy is not None:
        while thread.is_alive():
            with httpx.stream(
                "POST", f"{proxy.url}/v1/chat/completions", json=body(text, 600), timeout=300
            ) as r:
                for _ in r.iter_lines():
                    if not thread.is_alive():
                        break
    thread.join()
    return result[0]


def throughput(primary: LlamaServer, fallback: LlamaServer, work: Path) -> dict[str, float]:
    """Another client's rate on the fallback: alone, beside an answer streaming through a
    proxy that does not shadow (the same load on this machine's two cores), and beside one
    that is shadowed on the fallback."""
    text = prompt_of(2048, primary)
    rates = {"alone": other_client_rate(fallback, None, text)}
    for name in SETUPS:
        options = [*SETUPS[name], *QUIET]
        proxy = Mitmdump(primary.url, [fallback.url], options=options, log_dir=work)
        with running(proxy):
            proxy.servers_known()
            rates[f"beside an answer, {name}"] = other_client_rate(fallback, proxy, text)
    return rates


def fallback_server(model: Path, context: int, work: Path) -> LlamaServer:
    # --slot-save-path only so that its slots can be erased between runs.
    extra = ["--slot-save-path", str(work)]
    return LlamaServer(model, ctx_size=2 * context, slots=2, log_dir=work, extra_args=extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one run per cell")
    parser.add_argument("--part", choices=("all", "pauses", "throughput"), default="all")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="spillover-bench-shadow-"))
    medium = ensure_model(Path("models"), "medium", BENCH_PRESETS["medium"])
    smaller = ensure_model(Path("models"), "primary", PRESETS["primary"])
    context = max(CONTEXTS) + ANSWER + 600
    primary = LlamaServer(medium, ctx_size=2 * context, slots=2, log_dir=work)
    with running(primary):
        if args.part in ("all", "pauses"):
            with running(fallback := fallback_server(medium, context, work)):
                pauses(primary, fallback, 1 if args.quick else 3, work)
        if args.part in ("all", "throughput"):
            pairs = {}
            for name, model in (("same model", medium), ("4 x 256 fallback", smaller)):
                with running(fallback := fallback_server(model, 2048 + ANSWER + 600, work)):
                    pairs[name] = throughput(primary, fallback, work)
            print("\nanother client streaming on the fallback (tokens/s), 6 x 384 primary:")
            print(f"  {'':34}" + "".join(f"{name:>24}" for name in pairs))
            for row in next(iter(pairs.values())):
                cells = []
                for rates in pairs.values():
                    rate, base = rates[row], rates["beside an answer, no shadow"]
                    cells.append(f"{rate:12,.0f} {rate / base:5.2f}x")
                print(f"  {row:34}" + "".join(f"{c:>24}" for c in cells))


if __name__ == "__main__":
    main()
