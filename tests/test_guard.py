"""The fail-open guard (`scripts.guard`) with real processes: a llama-server, mitmdump
with the addon, and the guard on the clients' port. The proxy is killed (SIGKILL)
mid-traffic and started again; clients count their failed requests and how long each
way took."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from scripts.guard import CANNOT_START, GuardProcess
from scripts.testbed.mitm import Mitmdump
from tests.streams import chat_body
from tests.test_splice import held


class Traffic(threading.Thread):
    """One client asking again and again, a new connection each time:
    (started, finished, ok) per request."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.results, self.running = url, [], True

    def run(self) -> None:
        body = {**chat_body(4), "stream": False}
        while self.running:
            started = time.monotonic()
            try:
                ok = httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=5).is_success
            except httpx.HTTPError:
                ok = False
            self.results.append((started, time.monotonic(), ok))

    def first_ok_begun_after(self, moment: float, timeout: float) -> float | None:
        """When the first successful request begun after `moment` finished (a request
        already under way may still have finished through the dying proxy)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done = [end for start, end, ok in list(self.results) if start > moment and ok]
            if done:
                return done[0]
            time.sleep(0.02)
        return None

    def failed_between(self, start: float, end: float) -> int:
        return sum(1 for _, t, ok in self.results if start <= t <= end and not ok)


def via_proxy(guard: GuardProcess) -> bool:
    """Only the proxy answers this route: the primary has no /spillover/health."""
    return httpx.get(f"{guard.url}/spillover/health", timeout=5).status_code == 200


def test_clients_reach_the_primary_while_the_proxy_is_down_and_come_back(
    start_server, start_proxy, server_logs: Path
) -> None:
    primary = start_server("primary")
    proxy = start_proxy(primary.url, [])
    guard = GuardProcess(proxy.port, primary.url.split("//")[1], server_logs).start()
    traffic = Traffic(guard.url)
    try:
        assert via_proxy(guard)
        traffic.start()
        time.sleep(1.0)
        asked = time.monotonic()
        proxy.kill()  # waits until it is gone
        killed = time.monotonic()
        direct = traffic.first_ok_begun_after(killed, timeout=10)
        assert direct is not None and direct - killed < 3.0, direct
        time.sleep(1.0)
        assert not via_proxy(guard)

        restarted = time.monotonic()
        proxy.start()  # the same port, as a service manager would restart it
        deadline = time.monotonic() + 10
        while not via_proxy(guard) and time.monotonic() < deadline:
            time.sleep(0.05)
        back = time.monotonic()
        assert back - restarted < 10 and via_proxy(guard)
        time.sleep(1.0)
    finally:
        traffic.running = False
        traffic.join(timeout=10)
        guard.stop()
    # While the proxy was dying, at most the requests in flight through it failed; none
    # once the guard had switched, and none on the way back.
    assert traffic.failed_between(asked, direct) <= 3
    assert traffic.failed_between(direct, time.monotonic()) == 0
    assert traffic.failed_between(0, asked) == 0
    said = guard.said()
    assert any("new connections go straight to the primary" in line for line in said), said
    assert any("proxy answering again" in line for line in said), said
    print(
        f"\nguard: {traffic.failed_between(asked, direct)} failed, direct after "
        f"{(direct - killed) * 1000:.0f} ms; back through the proxy "
        f"{(back - restarted) * 1000:.0f} ms after its restart began"
    )


def test_a_hung_proxy_is_left_too(start_server, start_proxy, server_logs: Path) -> None:
    """SIGSTOP: the proxy still accepts connections but answers nothing. Its health route
    times out, so new connections go straight to the primary; requests already sent
    through it wait (here until it is let go)."""
    primary = start_server("primary")
    proxy = start_proxy(primary.url, [])
    guard = GuardProcess(proxy.port, primary.url.split("//")[1], server_logs).start()
    try:
        assert via_proxy(guard)
        stopped = time.monotonic()
        with held(proxy):
            deadline = stopped + 10
            while time.monotonic() < deadline:
                if any("straight to the primary" in line for line in guard.said()):
                    break
                time.sleep(0.05)
            switched = time.monotonic()
            assert switched - stopped < 3.0, guard.said()
            body = {**chat_body(4), "stream": False}
            reply = httpx.post(f"{guard.url}/v1/chat/completions", json=body, timeout=5)
            assert reply.status_code == 200 and not via_proxy(guard)
        deadline = time.monotonic() + 10
        while not via_proxy(guard) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert via_proxy(guard)
    finally:
        guard.stop()
    print(f"\nguard: a hung proxy left after {(switched - stopped) * 1000:.0f} ms")


def test_a_guard_on_a_public_address_must_be_told_so() -> None:
    """Behind it every client looks local to the proxy (see the guard's docstring)."""
    refused = subprocess.run(
        [sys.executable, "-m", "scripts.guard", "--listen", "0.0.0.0:1"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert refused.returncode == CANNOT_START and "spillover_control_local=false" in refused.stderr


def test_a_guard_on_a_taken_port_says_who_holds_it_in_one_line() -> None:
    """No asyncio traceback, and the exit code its unit will not restart on
    (RestartPreventExitStatus=, tests/test_systemd_units.py)."""
    with socket.create_server(("127.0.0.1", 0)) as held_port:
        port = held_port.getsockname()[1]
        refused = subprocess.run(
            [sys.executable, "-m", "scripts.guard", "--listen", f"127.0.0.1:{port}"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    me = Path(f"/proc/{os.getpid()}/comm").read_text().strip()
    assert refused.returncode == CANNOT_START, refused.stderr
    assert refused.stderr.splitlines() == [
        f"guard: 127.0.0.1:{port} is taken by pid {os.getpid()} ({me})"
    ]


def test_without_local_trust_the_control_routes_need_the_token(primary, server_logs: Path) -> None:
    options = [
        "spillover_shadow=off",
        "spillover_control_local=false",
        "spillover_control_token=s3",
    ]
    proxy = Mitmdump(primary.url, [], options=options, log_dir=server_logs)
    proxy.health_path = "/health"  # its own status route is closed to it now
    proxy.start()
    try:
        assert httpx.get(f"{proxy.url}/spillover/status").status_code == 404  # the primary's
        assert httpx.post(f"{proxy.url}/spillover/handoff").status_code == 404
        token = {"authorization": "Bearer s3"}
        admitted = httpx.get(f"{proxy.url}/spillover/status", headers=token)
        assert admitted.status_code == 200 and "routing" in admitted.json()
    finally:
        proxy.stop()


def test_idle_connections_are_bounded(start_server, start_proxy, server_logs: Path) -> None:
    """Idle sockets are closed after --idle-s, and past --max-connections the one idle
    the longest makes room: a client that asks meanwhile is answered at once."""
    primary = start_server("primary")
    proxy = start_proxy(primary.url, [])
    guard = GuardProcess(
        proxy.port, primary.url.split("//")[1], server_logs,
        extra_args=["--idle-s", "3", "--max-connections", "20"],
    ).start()  # fmt: skip
    idle = []
    try:
        for _ in range(40):
            idle.append(socket.create_connection(("127.0.0.1", guard.port)))
        body = {**chat_body(4), "stream": False}
        started = time.monotonic()
        reply = httpx.post(f"{guard.url}/v1/chat/completions", json=body, timeout=10)
        took = time.monotonic() - started
        assert reply.status_code == 200 and took < 2.0, took
        # The first 21 made room for the next and for the request; the rest close once
        # idle too long.
        assert sum(_closed(s, 0.5) for s in idle[:21]) == 21
        assert time.monotonic() - started < 2.5, "too slow to tell room from idleness"
        assert sum(_closed(s, 0.0) for s in idle[21:]) == 0
        assert sum(_closed(s, 6.0) for s in idle[21:]) == 19
    finally:
        for s in idle:
            s.close()
        guard.stop()


def _closed(sock: socket.socket, wait_s: float) -> bool:
    """Whether the guard closed `sock` (within `wait_s`)."""
    sock.settimeout(wait_s or 0.01)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True
