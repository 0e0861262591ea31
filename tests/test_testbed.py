"""The test bed is real: tiny models load in real llama-server processes and stream."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import openai
import pytest

from scripts.parts.processes import ManagedProcess, free_port
from scripts.testbed import llamacpppython
from scripts.testbed.llamabin import BUILD_VARIANTS, built_binary_path
from scripts.testbed.llamaserver import LlamaServer, ServerFailed, running
from scripts.testbed.tinymodels import PRESETS, build_vocab, write_model
from scripts.testbed.trial import EngineUnusable, first_build_that_runs, generates

PROMPT = [{"role": "user", "content": "Tell me about the river and the bridge."}]


def stream_text(server: LlamaServer, max_tokens: int = 48, **extra) -> tuple[str, list]:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    chunks = list(
        client.chat.completions.create(
            model="any", messages=PROMPT, max_tokens=max_tokens, temperature=0,
            stream=True, **extra,
        )
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def test_generator_is_byte_deterministic(tmp_path: Path) -> None:
    for name, preset in PRESETS.items():
        first = write_model(tmp_path / "a" / f"{name}.gguf", preset).read_bytes()
        second = write_model(tmp_path / "b" / f"{name}.gguf", preset).read_bytes()
        assert first == second, name
    written = {name: (tmp_path / "a" / f"{name}.gguf").read_bytes() for name in PRESETS}
    assert len(set(written.values())) == len(PRESETS)


def test_presets_share_one_tokenizer(primary: LlamaServer, fallback: LlamaServer) -> None:
    text = "The quick river, the old bridge: 42 stones!"
    ids = [
        httpx.post(f"{s.url}/tokenize", json={"content": text}).json()["tokens"]
        for s in (primary, fallback)
    ]
    assert ids[0] == ids[1]
    # Whole words are single tokens, so the vocabulary's prefixes let SentencePiece merge up.
    assert len(ids[0]) < len(text) / 2


def test_both_servers_stream_through_the_openai_sdk(
    primary: LlamaServer, fallback: LlamaServer
) -> None:
    for server in (primary, fallback):
        text, chunks = stream_text(server)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].choices[0].finish_reason == "length"
        assert len(text.split()) >= 10, text
        assert text.isprintable(), text
        props = httpx.get(f"{server.url}/props").json()
        assert props["default_generation_settings"]["n_ctx"] == 1024  # 4096 over 4 slots
        assert props["model_path"].endswith(("primary.gguf", "fallback.gguf"))


def test_greedy_output_is_repeatable(primary: LlamaServer, fallback: LlamaServer) -> None:
    for server in (primary, fallback):
        first, _ = stream_text(server)
        second, _ = stream_text(server)
        assert first == second
    assert stream_text(primary)[0] != stream_text(fallback)[0]


def test_usage_is_reported_when_asked(primary: LlamaServer) -> None:
    _, chunks = stream_text(primary, max_tokens=12, stream_options={"include_usage": True})
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 12 and usage.prompt_tokens > 5


def test_vocabulary_keeps_output_printable() -> None:
    tokens, _, _, bias = build_vocab()
    assert len(tokens) == len(set(tokens))
    assert {t for t, b in zip(tokens, bias, strict=True) if b == 0.0} <= {
        t for t in tokens if t[0] == "\u2581"
    }


def test_failed_start_shows_the_log(models: dict[str, Path], tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ServerFailed, match="exited"):
        LlamaServer(broken, log_dir=tmp_path).start()


def test_servers_stop_when_the_body_fails(models: dict[str, Path], tmp_path: Path) -> None:
    server = LlamaServer(models["fallback"], log_dir=tmp_path)
    with pytest.raises(RuntimeError, match="test body failed"), running(server):
        assert httpx.get(f"{server.url}/health").status_code == 200
        raise RuntimeError("test body failed")
    assert server.process is not None and server.process.poll() is not None


def test_servers_die_with_a_killed_parent(models: dict[str, Path], tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import time
            from pathlib import Path
            from scripts.testbed.llamaserver import LlamaServer
            server = LlamaServer(Path({str(models["fallback"])!r})).start()
            Path({str(pid_file)!r}).write_text(str(server.pid))
            time.sleep(60)
        """)],
        cwd=Path(__file__).parent.parent,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(pid_file.read_text())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return False
    return state != "Z"


class DiesOnFirstGeneration(ManagedProcess):
    """A stand-in for a build that loads, answers /health, and dies on its first matrix
    product (llama-cpp-python's native build where AMX is advertised but not granted):
    no real engine does that on demand here."""

    name = "dies-on-first-generation"

    def argv(self) -> list[str]:
        return [sys.executable, "-c", textwrap.dedent(f"""
            import os
            from http.server import BaseHTTPRequestHandler, HTTPServer
            class Handler(BaseHTTPRequestHandler):
                def do_GET(self):
                    self.send_response(200); self.end_headers()
                def do_POST(self):
                    os._exit(139)
            HTTPServer(("127.0.0.1", {self.port}), Handler).serve_forever()
        """)]  # fmt: skip


def test_an_engine_is_trusted_only_once_it_has_generated(
    models: dict[str, Path], tmp_path: Path
) -> None:
    assert generates(LlamaServer(models["fallback"], log_dir=tmp_path, slots=1)) is None
    dying = DiesOnFirstGeneration(log_dir=tmp_path)
    why = generates(dying)
    assert why is not None and why.startswith("dies-on-first-generation died with 139")
    assert dying.process is not None and dying.process.poll() is not None


def test_a_build_that_fails_its_trial_is_passed_over_for_the_next(
    capsys: pytest.CaptureFixture[str],
) -> None:
    built: list[str] = []

    def build(variant: str) -> str:
        built.append(variant)
        return f"{variant}-build"

    def verdict(which: str) -> str | None:
        return None if which == "portable-build" else f"{which} died with -4\nits log"

    chosen = first_build_that_runs("engine", ["native", "portable", "baseline"], build, verdict)
    assert chosen == "portable-build" and built == ["native", "portable"]
    assert "engine: the native build does not run here: native-build died with -4" in (
        capsys.readouterr().err
    )
    with pytest.raises(EngineUnusable) as failed:
        first_build_that_runs("engine", ["native", "baseline"], build, verdict)
    assert "the native build: native-build died" in str(failed.value)
    assert "the baseline build: baseline-build died" in str(failed.value)


def test_each_build_variant_has_a_cache_of_its_own() -> None:
    paths = {built_binary_path(v) for v in BUILD_VARIANTS}
    assert len(paths) == len(BUILD_VARIANTS)
    assert all(v in str(built_binary_path(v)) for v in BUILD_VARIANTS)
    assert all(v in str(llamacpppython.venv(v)) for v in BUILD_VARIANTS)


def test_ports_are_chosen_where_no_connection_takes_them(monkeypatch) -> None:
    """A server's port comes from below the ephemeral range, where no outgoing connection
    takes its local port, each test worker from a slice of its own; a port something
    listens on is passed over."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    chosen: dict[str, set[int]] = {}
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        chosen[worker] = {free_port() for _ in range(40)}
    assert all(port < low for ports in chosen.values() for port in ports)
    assert not chosen["gw0"] & chosen["gw1"]
    assert len(chosen["gw0"]) == 40  # none given twice
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        listened = taken.getsockname()[1]
        tries = iter([listened])
        chooses = random.randrange
        monkeypatch.setattr(random, "randrange", lambda a, b: next(tries, None) or chooses(a, b))
        assert free_port() != listened
