"""`spillover run --workers N`: N whole proxies behind HAProxy, for more answers at once
than one process (one core) carries.

Each worker is mitmdump with the addon on a loopback port of its own, with its own
memory watcher. HAProxy (Debian's package; `apt-get install haproxy`) listens where
clients connect: `leastconn` over the workers, each checked on its /spillover/health
every 2 s (every half second while its state changes), and the primary as a `backup`
server, so that clients reach the primary straight when no worker is up (the fail-open
guard's job, done by HAProxy). A worker that exits is started again on its port. On
SIGTERM or SIGINT every worker is put in HAProxy's drain state, its live answers end as
they would, and then all stop.

What must be one across the workers (surface/siblings.py): a control request sent to
any worker reaches all of them, and metrics are summed; the shadow budget
(`spillover_shadow_max`) is divided among them, so the servers see no more shadows than
with one process; migrations reserve restored slots by locks in the shared slot
directory.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from addon.servers.upstream import Upstream
from addon.surface.nftables import Nftables, NftablesError, redirect_to
from scripts.parts.processes import die_with_parent, free_port

DRAIN_S = 600.0  # the longest a stopping worker waits for its answers to end
CHECK_MS = 500
LISTEN_WAIT_S = 10
SHADOW_DEFAULT = 1  # the addon's spillover_shadow_max default


class HaproxyMissing(RuntimeError):
    pass


class RedirectFailed(RuntimeError):
    pass


def haproxy_binary() -> str:
    """HAProxy's program: SPILLOVER_HAPROXY, else `haproxy` on PATH or in the sbin
    directories."""
    named = os.environ.get("SPILLOVER_HAPROXY")
    if named is not None:
        found = named if os.access(named, os.X_OK) else None
    else:
        path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/local/sbin"])
        found = shutil.which("haproxy", path=path)
    if found is None:
        raise HaproxyMissing(
            f"--workers runs the workers behind HAProxy, and there is none "
            f"({named or 'haproxy'} not found): apt-get install haproxy (or your system's "
            "package), or name it in SPILLOVER_HAPROXY"
        )
    return found


def haproxy_config(
    listen: tuple[str, int],
    workers: Sequence[int],
    primary: str,
    admin_socket: Path,
    taken_port: int | None = None,
) -> str:
    """`taken_port`: where the kernel's rules send the primary's connections (every
    address, both families; `--transparent`)."""
    host, port = listen
    taken = f"\n    bind :::{taken_port} v4v6" if taken_port else ""
    target = Upstream(primary)
    backup = f"{target.host}:{target.port}"
    servers = "\n".join(
        f"    server w{i} 127.0.0.1:{worker} check" for i, worker in enumerate(workers)
    )
    tls = " ssl verify none" if target.tls else ""
    return f"""global
    stats socket {admin_socket} mode 600 level admin

defaults
    mode http
    timeout connect 2s
    timeout client 1h
    timeout server 1h
    timeout http-keep-alive 60s
    # A busy worker may take a while to answer its check: it is not down for that.
    timeout check 2s
    retries 2
    option redispatch
    # Every event goes out as it comes: without it HAProxy holds small writes back for
    # more (MSG_MORE), up to 200 ms a token.
    option http-no-delay

frontend spillover
    bind {host}:{port}{taken}
    # The control routes read the client's address from this header, set here only.
    http-request set-header x-spillover-peer %[src]
    http-request del-header x-spillover-fanned
    default_backend workers

backend workers
    balance leastconn
    option httpchk GET /spillover/health
    http-check expect status 200
    # Checked every 2 s (a line in each worker's log), every half second while one is
    # going down or coming up; a dead one's new requests go elsewhere at once meanwhile.
    default-server inter 2s fastinter {CHECK_MS}ms downinter {CHECK_MS}ms fall 2 rise 2
{servers}
    server primary {backup} backup{tls}
"""


class Workers:
    def __init__(
        self,
        primary: str,
        fallbacks: str,
        count: int,
        listen: tuple[str, int],
        mitmdump: list[str],
        extra: list[str],
        transparent: bool = False,
    ) -> None:
        """`mitmdump`: the command that starts mitmdump with the addon; `extra`, what the
        person gave it (`--set ...`); `transparent`: the kernel sends the primary's
        connections to HAProxy (rules this process holds: nftables.py)."""
        self.primary = primary.rstrip("/")
        self.fallbacks = fallbacks
        self.count = count
        self.listen = listen
        self.mitmdump = mitmdump
        self.extra = list(extra)
        self.ports = [free_port() for _ in range(count)]
        self._dir: Path | None = None  # HAProxy's config and admin socket, from start()
        self.admin_socket = Path()
        self.workers: list[subprocess.Popen[bytes] | None] = [None] * count
        self.haproxy: subprocess.Popen[bytes] | None = None
        self._stopping = False
        self.taken_port = free_port("::") if transparent else None
        self._rules: Nftables | None = None

    def worker_argv(self, index: int) -> list[str]:
        siblings = ",".join(f"http://127.0.0.1:{p}" for j, p in enumerate(self.ports) if j != index)
        extra, shadows = shadow_share(self.extra, index, self.count)
        return [
            *self.mitmdump,
            "--mode", f"reverse:{self.primary}@127.0.0.1:{self.ports[index]}",
            "--set", f"spillover_fallbacks={self.fallbacks}",
            "--set", f"spillover_siblings={siblings}",
            "--set", f"spillover_shadow_max={shadows}",
            *extra,
        ]  # fmt: skip

    def start(self) -> Workers:
        binary = haproxy_binary()
        self._dir = Path(tempfile.mkdtemp(prefix="spillover-workers-"))
        self.admin_socket = self._dir / "haproxy.sock"
        for index in range(self.count):
            self._start_worker(index)
        config = self._dir / "haproxy.cfg"
        config.write_text(
            haproxy_config(
                self.listen, self.ports, self.primary, self.admin_socket, self.taken_port
            )
        )
        # HAProxy first: while the workers start, clients reach the primary (its backup).
        self.haproxy = subprocess.Popen(
            [binary, "-f", str(config), "-db"], preexec_fn=die_with_parent
        )
        if self.taken_port is not None:
            self._redirect(self.taken_port)
        return self

    def _redirect(self, port: int) -> None:
        """Once HAProxy listens on `port`, have the kernel send the primary's connections
        there; the rules live as long as this process (or until stop)."""
        deadline = time.monotonic() + LISTEN_WAIT_S
        while True:
            try:
                socket.create_connection(("::1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.haproxy.poll() is not None:
                    self.stop()
                    raise RedirectFailed(f"HAProxy is not listening on {port}") from None
                time.sleep(0.05)
        try:
            self._rules = Nftables()
            self._rules.run(redirect_to(self.primary, port).ruleset())
        except (NftablesError, ValueError, OSError) as exc:
            self.stop()
            raise RedirectFailed(f"no redirect, so not started: {exc}") from exc

    def up(self) -> int:
        """How many workers HAProxy sends requests to now."""
        try:
            return sum(1 for fields in self.worker_stats() if fields[17] == "UP")
        except OSError:
            return 0

    def _start_worker(self, index: int) -> None:
        # Each child ends with the supervisor, however it ends: no worker or HAProxy is
        # left holding the ports.
        self.workers[index] = subprocess.Popen(self.worker_argv(index), preexec_fn=die_with_parent)

    def pids(self) -> list[int]:
        return [p.pid for p in (*self.workers, self.haproxy) if p is not None]

    def supervise(self) -> int:
        """Keep the workers running until told to stop (or HAProxy exits)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: setattr(self, "_stopping", True))
        announced = False
        while not self._stopping:
            if not announced and self.up() == self.count:
                host, port = self.listen
                print(f"spillover: {self.count} workers up behind HAProxy on {host}:{port}",
                      file=sys.stderr, flush=True)  # fmt: skip
                announced = True
            assert self.haproxy is not None
            if (code := self.haproxy.poll()) is not None:
                print(f"spillover: HAProxy exited ({code}); stopping", file=sys.stderr)
                self.stop()
                return 1
            for index, worker in enumerate(self.workers):
                if worker is not None and worker.poll() is not None:
                    said = f"worker {index} exited ({worker.returncode}); starting it again"
                    print(f"spillover: {said}", file=sys.stderr)
                    self._start_worker(index)
            time.sleep(0.2)
        self.stop()
        return 0

    def admin(self, command: str) -> str:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(str(self.admin_socket))
            sock.sendall(command.encode() + b"\n")
            return b"".join(iter(lambda: sock.recv(65536), b"")).decode()

    def worker_stats(self) -> list[list[str]]:
        """HAProxy's `show stat` row of each worker (field 4: its connections now, 17:
        its state)."""
        names = {f"w{index}" for index in range(self.count)}
        rows = [line.split(",") for line in self.admin("show stat").splitlines()]
        return [f for f in rows if len(f) > 17 and f[0] == "workers" and f[1] in names]

    def stop(self) -> None:
        """Drain every worker (no new requests; the live ones end as they would), then
        stop them and HAProxy. Redirected clients reach the primary itself at once."""
        if self._rules is not None:
            self._rules.close()
            self._rules = None
        if self.haproxy is not None and self.haproxy.poll() is None:
            try:
                for index in range(self.count):
                    self.admin(f"set server workers/w{index} state drain")
                deadline = time.monotonic() + DRAIN_S
                while time.monotonic() < deadline and any(
                    int(fields[4] or 0) for fields in self.worker_stats()
                ):
                    time.sleep(0.2)
            except OSError as exc:
                print(f"spillover: could not drain the workers: {exc}", file=sys.stderr)
        for process in (*self.workers, self.haproxy):
            if process is not None and process.poll() is None:
                process.terminate()
        for process in (*self.workers, self.haproxy):
            if process is not None:
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


def shadow_share(extra: list[str], index: int, count: int) -> tuple[list[str], int]:
    """`extra` without its spillover_shadow_max, and worker `index`'s share of it: the
    budget divided among the workers, the remainder to the first ones."""
    total, kept, skip = SHADOW_DEFAULT, [], False
    for i, arg in enumerate(extra):
        if skip:
            skip = False
            continue
        if (
            arg == "--set"
            and i + 1 < len(extra)
            and extra[i + 1].startswith("spillover_shadow_max=")
        ):
            total = int(extra[i + 1].split("=", 1)[1])
            skip = True
            continue
        kept.append(arg)
    return kept, total // count + (1 if index < total % count else 0)
