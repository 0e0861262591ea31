"""An engine is trusted only once it has generated here: started on a tiny model and asked
for a few tokens. Coming up healthy is not enough: a native build on a CPU that advertises
AMX to a process the kernel grants no tile state loads its model, answers /health, and
dies on its first matrix product. Verdicts are cached by what was tried and on which CPU.

Where an engine is built here, its builds are tried in order (`llamabin.BUILD_VARIANTS`):
the native one first, then portable ones, each only when the one before failed its trial.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx

from scripts.parts.processes import ManagedProcess, ServerFailed
from scripts.testbed.llamabin import CACHE, cpu_key
from scripts.testbed.tinymodels import ensure_models

# A verdict written by an older trial (one that only waited for /health) is not reused.
TRIAL = "generates-4-tokens"


class EngineUnusable(RuntimeError):
    """No build of an engine generates on this machine; the message says what each did."""


def generates(server: ManagedProcess, model: str | None = None, timeout: float = 60) -> str | None:
    """None when `server` starts and writes a few tokens of a text completion; otherwise
    why not, with the tail of its log. The server is stopped either way."""
    body = {"prompt": "the river", "max_tokens": 4, "temperature": 0}
    try:
        server.start(timeout)
        reply = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": model, **body} if model else body,
            timeout=timeout,
        )
        reply.raise_for_status()
        tokens = reply.json()["usage"]["completion_tokens"]
        return None if tokens > 0 else "it answered with no tokens"
    except ServerFailed as exc:
        return str(exc)
    except (httpx.HTTPError, KeyError, TypeError, ValueError) as exc:
        assert server.process is not None
        try:  # a crash drops the connection a moment before the process is gone
            code: int | None = server.process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            code = None
        how = f"died with {code}" if code is not None else "failed"
        return f"{server.name} {how} on its first generation ({exc!r}):\n{server.log_tail()}"
    finally:
        server.stop()


def verdict(
    what: str,
    identity: str,
    server_on: Callable[[Path], ManagedProcess],
    *,
    model: str | None = None,
    timeout: float = 60,
) -> str | None:
    """Whether `server_on(a tiny GGUF)` generates (None) or why not, asked once per
    `identity` (what was built or installed) and CPU."""

    def trial() -> str | None:
        with tempfile.TemporaryDirectory() as tmp:
            gguf = ensure_models(Path(tmp))["fallback"]
            return generates(server_on(gguf), model=model, timeout=timeout)

    return _cached(what, identity, trial)


def _cached(what: str, identity: str, trial: Callable[[], str | None]) -> str | None:
    key = hashlib.sha256(f"{TRIAL}:{identity}".encode()).hexdigest()[:16]
    verdict_file = CACHE / "probes" / f"{what}-{key}-{cpu_key()}"
    if verdict_file.exists():
        text = verdict_file.read_text()
        return None if text == "ok" else text
    why = trial()
    verdict_file.parent.mkdir(parents=True, exist_ok=True)
    verdict_file.write_text("ok" if why is None else why)
    return why


def file_identity(path: Path) -> str:
    """What changes when a binary is rebuilt or replaced."""
    stat = path.stat()
    return f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"


def first_build_that_runs[Built](
    what: str,
    variants: Sequence[str],
    build: Callable[[str], Built],
    verdict: Callable[[Built], str | None],
) -> Built:
    """Build each variant in turn (what `build` has cached is reused) until one passes its
    trial; says on stderr when a build is passed over. Raises EngineUnusable."""
    failures = []
    for variant in variants:
        built = build(variant)
        why = verdict(built)
        if why is None:
            return built
        first_line = why.splitlines()[0] if why else "no reason given"
        failures.append(f"the {variant} build: {why}")
        print(f"{what}: the {variant} build does not run here: {first_line}", file=sys.stderr)
    raise EngineUnusable(f"no build of {what} generates on this machine:\n" + "\n".join(failures))
