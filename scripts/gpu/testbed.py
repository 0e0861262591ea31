"""The GPU proof's test bed (`scripts/gpu/proof.py`): the primary llama-server on the GPU,
the fallback on the CPU, a real mitmdump with the addon in front; and one measured run:
an answer streamed through the proxy, judged the way the test suite judges a handoff
(`tests/streams.py`), with the times its handoff note and first fallback text arrived."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scripts.gpu.stats import RunResult, Summary

REPO = Path(__file__).resolve().parents[2]
# mitmdump from whatever this Python imports mitmproxy from (a venv, or the bundle's wheels
# installed with --target), where no `mitmdump` script sits next to the interpreter
MITMDUMP = "import sys; from mitmproxy.tools.main import mitmdump; sys.exit(mitmdump())"


class ProofBed:
    """The primary on the GPU, the fallback on the CPU, mitmdump with the addon in front;
    all stopped on leaving, whatever happens."""

    def __init__(
        self,
        binary: Path,
        models: dict[str, Path],
        uuid: str,
        work: Path,
        dwell: int,
        fallback_binary: Path | None = None,
    ) -> None:
        from scripts.parts.processes import ServerFailed
        from scripts.testbed.mitm import Mitmdump

        self.models, self.uuid, self.work = models, uuid, work
        self.flows = work / "flows.mitm"
        self._failed = ServerFailed
        env = {"CUDA_VISIBLE_DEVICES": uuid}
        self.primary = self._server("primary", binary, env, gpu_layers=99)
        # The fallback sees no CUDA device: it runs on the CPU and holds no card open.
        self.fallback = self._server(
            "fallback", fallback_binary or binary, {"CUDA_VISIBLE_DEVICES": ""}
        )

        class ProofMitmdump(Mitmdump):
            def argv(self) -> list[str]:  # this Python's mitmproxy, wherever it came from
                return [sys.executable, "-c", MITMDUMP, *super().argv()[1:]]

        options = [f"save_stream_file={self.flows}", f"spillover_dwell_s={dwell}"]
        self.proxy = ProofMitmdump(
            self.primary.url, [self.fallback.url], options=options, log_dir=work
        )

    def _server(
        self, model: str, binary: Path, env: dict[str, str], gpu_layers: int | None = None
    ) -> Any:
        from scripts.testbed.llamaserver import LlamaServer

        class GpuLlamaServer(LlamaServer):
            """LlamaServer runs on the CPU; this one chooses its own GPU use and env."""

            def argv(self) -> list[str]:
                return ["env", *(f"{k}={v}" for k, v in env.items()), *super().argv()]

        server = GpuLlamaServer(
            self.models[model], binary=binary, ctx_size=8192, slots=2, log_dir=self.work
        )
        if gpu_layers is not None and "--device" in server.args:
            at = server.args.index("--device")
            del server.args[at : at + 2]
            server.args[server.args.index("--n-gpu-layers") + 1] = str(gpu_layers)
        return server

    def __enter__(self) -> ProofBed:
        try:
            self.primary.start(timeout=120)
            try:
                self.fallback.start(timeout=60)
            except self._failed:  # a CUDA build that will not start without a device
                self.fallback.argv = lambda: [str(self.fallback.binary), *self.fallback.args]
                self.fallback.start(timeout=60)
            self.proxy.start(timeout=60)
            self.proxy.servers_known(timeout=30)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        for process in (self.proxy, self.fallback, self.primary):
            process.stop()

    def status(self) -> dict[str, Any]:
        import httpx

        return httpx.get(f"{self.proxy.url}/spillover/status", timeout=5).json()

    def metrics(self) -> str:
        import httpx

        return httpx.get(f"{self.proxy.url}/spillover/metrics", timeout=5).text

    def doctor(self) -> str:
        servers = f"{self.primary.url},{self.fallback.url}"
        done = subprocess.run(
            [sys.executable, "-m", "scripts.doctor", "--servers", servers],
            cwd=REPO, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        return (done.stdout + done.stderr).rstrip()

    def card_of_primary(self, summary: Summary) -> str:
        """The card the addon found the primary on (by its port: pid, then NVML's process
        list or the device files it holds); the fallback should be on none."""
        deadline = time.monotonic() + 15
        while True:
            mapping = self.status().get("memory", {}).get("servers", {})
            summary.extra["cards_of_servers"] = mapping
            cards = [c for c in cards_in(mapping.get(self.primary.url)) if c.startswith("nvml:")]
            if len(cards) == 1:
                print(f"cards found: {mapping}")
                if cards[0] in cards_in(mapping.get(self.fallback.url)):
                    summary.extra.setdefault("errors", []).append(
                        f"the CPU fallback was mapped onto {cards[0]} too (try --fallback-binary "
                        "with a CPU build)"
                    )
                return cards[0]
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the addon did not find the primary on one NVML card: {mapping}"
                )
            time.sleep(0.1)

    def ready(self, card: str, until: float) -> bool:
        """Wait until the card is armed, the primary takes new requests and no answer is live."""
        while time.monotonic() < until:
            status = self.status()
            armed = status.get("memory", {}).get("cards", {}).get(card, {}).get("armed")
            states = status.get("routing", {}).get("states", {})
            state = states.get(self.primary.url, {}).get("state")
            if armed and state == "ok" and not status.get("live"):
                return True
            time.sleep(0.02)
        return False

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
