"""Fixtures for the real test bed: tiny models and llama-server processes."""

from __future__ import annotations

import os
import ssl
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.mitm import Mitmdump
from scripts.testbed.tinymodels import ensure_models

# The tests make an httpx client for nearly every call (httpx.get, httpx.stream), and a
# client loads its whole CA bundle when made: 20-25 ms of CPU each, which polling loops
# turned into most of the suite's CPU time. They speak plain HTTP on loopback; a CA
# directory is read only when a TLS peer is verified.
os.environ.pop("SSL_CERT_FILE", None)
os.environ["SSL_CERT_DIR"] = ssl.get_default_verify_paths().capath or "/etc/ssl/certs"


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return ensure_models(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def server_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("server-logs")


@pytest.fixture(scope="session")
def primary(models: dict[str, Path], server_logs: Path) -> Iterator[LlamaServer]:
    """The shared primary; tests that kill or stall a server start their own."""
    server = LlamaServer(models["primary"], log_dir=server_logs).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def fallback(models: dict[str, Path], server_logs: Path) -> Iterator[LlamaServer]:
    server = LlamaServer(models["fallback"], log_dir=server_logs).start()
    yield server
    server.stop()


def _starting_servers(
    models: dict[str, Path], server_logs: Path
) -> Iterator[Callable[..., LlamaServer]]:
    started: list[LlamaServer] = []

    def start(model: str | Path = "primary", **kwargs) -> LlamaServer:
        """`model`: one of the test models by name, or a model file."""
        path = model if isinstance(model, Path) else models[model]
        server = LlamaServer(path, log_dir=server_logs, **kwargs)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def start_server(
    models: dict[str, Path], server_logs: Path
) -> Iterator[Callable[..., LlamaServer]]:
    """Start a private llama-server for one test (stopped at teardown, pass or fail)."""
    yield from _starting_servers(models, server_logs)


@pytest.fixture(scope="module")
def start_server_module(
    models: dict[str, Path], server_logs: Path
) -> Iterator[Callable[..., LlamaServer]]:
    """Like start_server, for servers a whole test module shares."""
    yield from _starting_servers(models, server_logs)


@pytest.fixture(scope="session")
def proxy(primary: LlamaServer, fallback: LlamaServer, server_logs: Path) -> Iterator[Mitmdump]:
    """mitmdump with the addon in front of the shared primary and fallback."""
    mitm = Mitmdump(primary.url, [fallback.url], log_dir=server_logs, options=SHADOW_OFF).start()
    yield mitm
    mitm.stop()


# Shadow prefill starts by default where a card is near a line, and system RAM is a card:
# whether it is near depends on the machine. Tests say when they want shadows.
SHADOW_OFF = ["spillover_shadow=off"]


def _starting_proxies(server_logs: Path) -> Iterator[Callable[..., Mitmdump]]:
    started: list[Mitmdump] = []

    def start(primary: str, fallbacks: list[str], options=(), **kwargs) -> Mitmdump:
        if not any(o.startswith("spillover_shadow=") for o in options):
            options = [*SHADOW_OFF, *options]  # (mitmproxy fails an option set twice)
        mitm = Mitmdump(primary, fallbacks, log_dir=server_logs, options=options, **kwargs)
        started.append(mitm)
        return mitm.start()

    yield start
    for mitm in started:
        mitm.stop()


@pytest.fixture
def start_proxy(server_logs: Path) -> Iterator[Callable[..., Mitmdump]]:
    """Start a private mitmdump for one test (stopped at teardown)."""
    yield from _starting_proxies(server_logs)


@pytest.fixture(scope="module")
def start_proxy_module(server_logs: Path) -> Iterator[Callable[..., Mitmdump]]:
    yield from _starting_proxies(server_logs)
