"""A real mitmdump process running the spillover addon in front of a primary."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from scripts.parts.processes import ManagedProcess, ServerFailed
from scripts.testbed.memfiles import FakeCard

REPO = Path(__file__).resolve().parents[2]
ADDON = REPO / "addon" / "spillover.py"


def watch_sysfs(sysfs: Path, cards: dict[str, str]) -> list[str]:
    """Options that make the addon's watcher read a sysfs tree, with {server URL: card}."""
    mapping = ",".join(f"{url}={card}" for url, card in cards.items())
    return [
        f"spillover_sysfs_root={sysfs}",
        "spillover_sources=sysfs",
        f"spillover_cards={mapping}",
    ]


def ram_and_elsewhere(server: str, sysfs: Path) -> list[str]:
    """Options that watch this machine's RAM and put `server` on a card of its own in a
    sysfs tree (standing for a server elsewhere: it is never under this RAM's pressure)."""
    FakeCard(sysfs, "card9", total_mib=16384, used_mib=1000)
    return [
        f"spillover_sysfs_root={sysfs}",
        "spillover_sources=meminfo,sysfs",
        f"spillover_cards={server}=drm:card9",
    ]


class Mitmdump(ManagedProcess):
    """`mitmdump` in reverse-proxy mode; with `addon=False`, plain mitmdump for comparison."""

    name = "mitmdump"

    def __init__(
        self,
        primary: str,
        fallbacks: Sequence[str] = (),
        *,
        addon: bool = True,
        options: Sequence[str] = (),
        port: int | None = None,
        log_dir: Path | None = None,
        scripts: Sequence[Path] = (),
        host: str = "127.0.0.1",
        addon_path: Path = ADDON,
        mitmdump: Path | None = None,
    ) -> None:
        """`scripts`: more addon scripts, loaded after the spillover addon;
        `addon_path`: the addon's file and `mitmdump` the program (an installed one's,
        say; by default this checkout's and this Python's)."""
        super().__init__(port, log_dir, host)
        self.scripts = list(scripts)
        self.addon_path = addon_path
        self.mitmdump = mitmdump or Path(sys.executable).parent / "mitmdump"
        self.primary = primary
        self.fallbacks = list(fallbacks)
        self.addon = addon
        self.options = list(options)
        # With the addon, its own health route (503 until every proxy mode is up: the
        # local capture's redirector starts after the reverse port answers); plain
        # mitmdump proxies /health.
        self.health_path = "/spillover/health" if addon else "/health"

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Healthy, and the addon that answers is this process's: another process may
        hold the port this one failed to bind."""
        super().wait_healthy(timeout)
        if self.health_path != "/spillover/health":
            return  # plain mitmdump, or a proxy whose control routes are closed to tests
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(httpx.TransportError):
                if self.status().get("pid") == self.pid:
                    return
            assert self.process is not None
            if self.process.poll() is not None or time.monotonic() > deadline:
                ended = self.process.poll() is not None
                self.stop()
                why = "ended" if ended else f"another process answers on {self.port}"
                raise ServerFailed(f"{self.name}: {why}:\n{self.log_tail()}")
            time.sleep(0.02)

    def status(self) -> dict[str, Any]:
        """The addon's /spillover/status, as it answers now."""
        return httpx.get(f"{self.url}/spillover/status", timeout=30).json()

    def servers_known(self, timeout: float = 30) -> dict[str, Any]:
        """Wait until the addon has asked each of its servers about itself (it does so in
        the background at start), and each fallback that answers without a key has
        settled whether it continues (on a loaded machine a start-up question can time
        out; the addon then asks again); returns what it learned, by server URL."""
        urls = [self.primary, *self.fallbacks]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            servers = self.status()["servers"]
            known = [servers.get(url, {}) for url in urls]
            if all(info.get("asked") for info in known) and all(
                _settled(info) for info in known[1:]
            ):
                return servers
            time.sleep(0.02)
        raise ServerFailed(f"the addon never heard back from {urls}: {servers}")

    def argv(self) -> list[str]:
        argv = [
            str(self.mitmdump),
            "--mode", f"reverse:{self.primary}@{self.host}:{self.port}",
            "--set", "flow_detail=0",
        ]  # fmt: skip
        if self.addon:
            fallbacks = ",".join(self.fallbacks)
            argv += ["-s", str(self.addon_path), "--set", f"spillover_fallbacks={fallbacks}"]
        else:
            argv += ["--set", "stream_large_bodies=1", "--set", "connection_strategy=lazy"]
        for script in self.scripts:
            argv += ["-s", str(script)]
        for option in self.options:
            argv += ["--set", option]
        return argv


def _settled(fallback: dict[str, Any]) -> bool:
    """Whether a fallback's answer to "does it continue?" is final: it answered, or it
    cannot (it is down, or it turns the addon away for want of a key)."""
    down = {"/props", "/v1/models"} <= set(fallback["unanswered"])
    return fallback["settled"] or down or fallback["wants_key"]


class SpilloverRun(Mitmdump):
    """The proxy as a user starts it: `spillover run` with its own `flags` (such as
    --transparent), the options after `--`; `prefix` runs it (as `unshare ...`)."""

    def __init__(
        self,
        primary: str,
        fallbacks: Sequence[str],
        flags: Sequence[str],
        prefix: Sequence[str] = (),
        **kwargs,
    ):
        super().__init__(primary, fallbacks, **kwargs)
        self.flags = list(flags)
        self.prefix = list(prefix)

    def argv(self) -> list[str]:
        argv = [
            *self.prefix, sys.executable, "-m", "scripts.cli", "run", "--primary", self.primary,
            "--fallbacks", ",".join(self.fallbacks), "--port", str(self.port), *self.flags,
            "--", "--set", "flow_detail=0",
        ]  # fmt: skip
        for option in self.options:
            argv += ["--set", option]
        return argv

    def environment(self) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": str(REPO)}  # `-m scripts.cli` from any directory
