"""The GPU proof's test bed (`scripts/gpu/proof.py`, and its CPU rehearsal): llama-servers
on the GPU or the CPU, a real mitmdump with the addon in front; and one measured run:
an answer streamed through the proxy, judged the way the test suite judges a handoff
(`tests/streams.py`), with the times its handoff note and first fallback text arrived."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from scripts.gpu.stats import RunResult, Summary

REPO = Path(__file__).resolve().parents[2]
# mitmdump from whatever this Python imports mitmproxy from (a venv, or the bundle's wheels
# installed with --target), where no `mitmdump` script sits next to the interpreter
MITMDUMP = "import sys; from mitmproxy.tools.main import mitmdump; sys.exit(mitmdump())"


def llama_server(
    model: Path,
    binary: Path,
    work: Path,
    *,
    gpu: str | None,
    ctx_size: int = 8192,
    slots: int = 2,
    threads: int = 1,
    extra_args: Sequence[str] = (),
) -> Any:
    """A llama-server with every layer on the card of UUID `gpu`, or (None) on the CPU
    with no CUDA device visible, so it holds no card open."""
    from scripts.parts.processes import ServerFailed
    from scripts.testbed.llamaserver import LlamaServer

    class Server(LlamaServer):
        visible: str | None = gpu or ""

        def environment(self) -> dict[str, str] | None:
            if self.visible is None:
                return None
            return {**os.environ, "CUDA_VISIBLE_DEVICES": self.visible}

        def start(self, timeout: float = 30.0) -> Any:
            try:
                return super().start(timeout)
            except ServerFailed:
                if self.visible != "":
                    raise
                self.visible = None  # a CUDA build that will not start without a device
                return super().start(timeout)

    server = Server(
        model, binary=binary, ctx_size=ctx_size, slots=slots, threads=threads, log_dir=work,
        extra_args=extra_args,
    )  # fmt: skip
    if gpu is not None:
        at = server.args.index("--device")
        del server.args[at : at + 2]
        server.args[server.args.index("--n-gpu-layers") + 1] = "99"
    return server


def mitmdump(primary: Any, fallbacks: list[Any], options: list[str], work: Path) -> Any:
    """mitmdump with the addon in front of these servers, run by this Python's mitmproxy
    (a venv's, or the bundle's wheels installed with --target)."""
    from scripts.testbed.mitm import Mitmdump

    class ProofMitmdump(Mitmdump):
        def argv(self) -> list[str]:
            return [sys.executable, "-c", MITMDUMP, *super().argv()[1:]]

    return ProofMitmdump(primary.url, [f.url for f in fallbacks], options=options, log_dir=work)


def start_all(processes: Sequence[Any], timeout: float) -> None:
    """Launch them all, then wait for each: models load side by side. One that fails is
    started again on its own (a CUDA build refusing to start without a device retries
    without hiding it)."""
    from scripts.parts.processes import ServerFailed

    for process in processes:
        process.launch()
    for process in processes:
        try:
            process.wait_healthy(timeout)
        except ServerFailed:
            process.start(timeout)


class ProofBed:
    """The servers, and mitmdump with the addon in front of them once `start_proxy` is
    called (after the ballast: what the card holds when the proxy first reads it is its
    rest); all stopped on leaving, whatever happens."""

    def __init__(self, primary: Any, fallbacks: list[Any], work: Path, options: list[str]):
        self.primary, self.fallbacks, self.work = primary, fallbacks, work
        self.flows = work / "flows.mitm"
        self.proxy = mitmdump(
            primary, fallbacks, [f"save_stream_file={self.flows}", *options], work
        )

    def __enter__(self) -> ProofBed:
        try:
            start_all([self.primary, *self.fallbacks], timeout=180)
        except BaseException:
            self.__exit__()
            raise
        return self

    def start_proxy(self) -> None:
        self.proxy.start(timeout=60)
        self.proxy.servers_known(timeout=30)

    def __exit__(self, *_: object) -> None:
        for process in (self.proxy, *self.fallbacks, self.primary):
            process.stop()

    def status(self) -> dict[str, Any]:
        import httpx

        return httpx.get(f"{self.proxy.url}/spillover/status", timeout=5).json()

    def metrics(self) -> str:
        import httpx

        return httpx.get(f"{self.proxy.url}/spillover/metrics", timeout=5).text

    def doctor(self) -> str:
        servers = ",".join(s.url for s in (self.primary, *self.fallbacks))
        done = subprocess.run(
            [sys.executable, "-m", "scripts.doctor", "--servers", servers],
            cwd=REPO, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        return (done.stdout + done.stderr).rstrip()

    def card_of_primary(self, summary: Summary, kind: str = "nvml:") -> str:
        """The one card (of this kind) the addon found the primary on: by its port (pid,
        then NVML's process list or the device files it holds), or as it was told; a
        fallback on the same card is said (a handoff never goes onto a card under
        pressure, so it is passed over in those runs)."""
        deadline = time.monotonic() + 15
        while True:
            mapping = self.status().get("memory", {}).get("servers", {})
            summary.extra["cards_of_servers"] = mapping
            cards = [c for c in cards_in(mapping.get(self.primary.url)) if c.startswith(kind)]
            if len(cards) == 1:
                print(f"cards found: {mapping}")
                shared = [f.url for f in self.fallbacks if cards[0] in cards_in(mapping.get(f.url))]
                if shared:
                    summary.extra["fallbacks_on_the_primarys_card"] = shared
                return cards[0]
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the addon did not find the primary on one {kind} card: {mapping}"
                )
            time.sleep(0.1)

    def flows_metadata(self, summary: Summary) -> list[dict[str, Any]]:
        try:
            from mitmproxy import io

            with self.flows.open("rb") as file:
                return [flow.metadata for flow in io.FlowReader(file).stream()]
        except Exception as exc:  # optional: the table goes on without it
            summary.extra.setdefault("errors", []).append(f"reading {self.flows}: {exc!r}")
            return []


def cards_in(mapping: Any) -> list[str]:
    """A server's cards in the status: a list, or {"cards": [...], "how": ...}."""
    if isinstance(mapping, dict):
        mapping = mapping.get("cards")
    return list(mapping) if isinstance(mapping, list) else []


def one_run(
    index: int,
    url: str,
    trigger: Callable[[], None],
    after_chunks: int,
    max_tokens: int,
    expect: str = "memory pressure on ",
) -> RunResult:
    """Stream one answer through the proxy, call `trigger` after `after_chunks` chunks, and
    time when the handoff note and the first fallback text reach the client."""
    import httpx

    from tests.streams import RawStream, chat_body, record

    stream, chunk_times, note_times = RawStream(), [], []
    body = chat_body(max_tokens)
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as response:
            stream.status = response.status_code
            for line in response.iter_lines():
                now = time.monotonic()
                chunks = len(stream.chunks)
                record(stream, line)
                if line.startswith(":"):
                    note_times.append(now)
                if len(stream.chunks) > chunks:
                    chunk_times.append(now)
                    if len(stream.chunks) == after_chunks:
                        trigger()
    except httpx.HTTPError as exc:  # a broken answer is a finding, not the end of the proof
        stream.errors.append({"client": repr(exc)})
    return measure(index, stream, chunk_times, note_times, max_tokens, expect)


def measure(
    index: int,
    stream: Any,
    chunk_times: list[float],
    note_times: list[float],
    max_tokens: int,
    expect: str,
) -> RunResult:
    """The verdict on a recorded stream (tests.streams.RawStream), and when its first
    handoff note and the first text after it arrived (one time per chunk and per note)."""
    why = judge(stream, max_tokens, expect)
    result = RunResult(index, why is None, why or "", tokens=sum(stream.segment_tokens))
    handoffs = [i for i, note in enumerate(stream.notes) if "handoff" in note]
    if handoffs:
        first = handoffs[0]
        result.note, result.note_at = stream.notes[first], note_times[first]
        for at in range(stream.note_at[first], len(stream.chunks)):
            if any((c.get("delta") or {}).get("content") for c in stream.chunks[at]["choices"]):
                result.fallback_at = chunk_times[at]
                break
    return result


def judge(stream: Any, max_tokens: int, expect: str) -> str | None:
    """What keeps this stream from being one clean continued answer, or None."""
    from tests.streams import assert_one_clean_stream

    if stream.errors:
        return f"errors in the stream: {stream.errors}"
    try:
        assert_one_clean_stream(stream)
    except AssertionError as exc:
        return f"not one clean stream: {exc or 'assertion failed'}"
    handoffs = [note for note in stream.notes if "handoff" in note]
    if len(handoffs) != 1:
        return f"{len(handoffs)} handoff notes: {stream.notes}"
    if expect not in handoffs[0]:
        return f"handoff for another reason: {handoffs[0]}"
    if sum(stream.segment_tokens) != max_tokens:
        return f"{sum(stream.segment_tokens)} tokens of {max_tokens}"
    return None
