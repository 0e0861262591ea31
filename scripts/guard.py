"""The fail-open guard: clients keep reaching the primary when the proxy is down.

    .venv/bin/python -m scripts.guard --listen 127.0.0.1:8090 \\
        --proxy 127.0.0.1:8091 --primary 127.0.0.1:8081

The guard owns the port clients use and relays each new connection, byte for byte, to the
proxy (mitmdump with the addon) while the proxy answers its health route
(`GET /spillover/health`), and straight to the primary when it does not: after
`--fails` missed checks in a row (checks every `--every-s`, each allowed `--timeout-s`),
or at once for a connection the proxy refuses. It goes back through the proxy after
`--passes` answered checks in a row. Connections keep the way they started on; each
switch is printed with the time. The fix can then never become the outage.

Behind a guard every client looks local to the proxy. Listening on a non-loopback
address therefore needs `--public`, and the proxy run with
`--set spillover_control_local=false` (its control routes then need the token): give the
guard the same token with `--token-file`, so that its health check is still answered by
the proxy and not passed on to the primary (`scripts.services` sets both up).

A connection that carries nothing either way for `--idle-s` is closed, and when the
connections would use more descriptors than the guard may open, the one idle the longest
makes room for the new one: idle sockets cannot starve the clients that are asking.

A guard that cannot start (its address taken, a non-loopback one without `--public`, no
token file) says why in one line and exits with `CANNOT_START`, which its unit names in
`RestartPreventExitStatus=`: restarting would not help.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from pathlib import Path

from addon.surface.openfiles import raise_open_files
from scripts.parts.ports import address, is_loopback, listen_error
from scripts.parts.processes import ManagedProcess

CANNOT_START = 78  # sysexits' EX_CONFIG
CONNECT_TIMEOUT_S = 2.0
READ_SIZE = 65536
IDLE_S = 600.0  # longer than a long prompt's reading, when a stream is silent both ways


def health_request(token: str) -> bytes:
    bearer = f"Authorization: Bearer {token}\r\n" if token else ""
    return (
        f"GET /spillover/health HTTP/1.1\r\nHost: guard\r\n{bearer}Connection: close\r\n\r\n"
    ).encode()


def connection_limit() -> int:
    """How many relayed connections fit in the descriptors this process may open (two
    each), after raising its soft limit as far as the hard one allows."""
    return max(1, raise_open_files().relayed)


class Relayed:
    """One client connection and the one it is relayed to, with when bytes last moved."""

    def __init__(self, client: asyncio.StreamWriter) -> None:
        self.sides = [client]
        self.last = time.monotonic()

    def close(self) -> None:
        for side in self.sides:
            side.transport.abort()


def say(line: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} guard: {line}", flush=True)


class Guard:
    def __init__(
        self,
        proxy: tuple[str, int],
        primary: tuple[str, int],
        every_s: float = 0.5,
        timeout_s: float = 1.0,
        fails: int = 2,
        passes: int = 2,
        token: str = "",
        idle_s: float = IDLE_S,
        max_connections: int | None = None,
    ) -> None:
        self.proxy, self.primary = proxy, primary
        self.every_s, self.timeout_s = every_s, timeout_s
        self.fails, self.passes = fails, passes
        self.via_proxy = True
        self.idle_s = idle_s
        self.max_connections = max_connections or connection_limit()
        self.open: set[Relayed] = set()
        self._health = health_request(token)
        self._streak = 0  # checks in a row that disagree with the current way

    async def close_idle(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.idle_s / 4))
            cutoff = time.monotonic() - self.idle_s
            for relayed in [r for r in self.open if r.last < cutoff]:
                self.open.discard(relayed)
                relayed.close()

    def make_room(self) -> None:
        """Close the connection idle the longest when the next one would not fit."""
        if len(self.open) >= self.max_connections:
            longest = min(self.open, key=lambda r: r.last)
            self.open.discard(longest)
            longest.close()

    async def watch(self) -> None:
        while True:
            answered, why = await self.check()
            self._streak = 0 if answered == self.via_proxy else self._streak + 1
            if self.via_proxy and self._streak >= self.fails:
                self.via_proxy, self._streak = False, 0
                say(f"proxy not answering ({why}): new connections go straight to the primary")
            elif not self.via_proxy and self._streak >= self.passes:
                self.via_proxy, self._streak = True, 0
                say("proxy answering again: new connections go through it")
            await asyncio.sleep(self.every_s)

    async def check(self) -> tuple[bool, str]:
        """Whether the proxy itself answers its health route, and if not, why."""
        host, port = self.proxy
        try:
            async with asyncio.timeout(self.timeout_s):
                reader, writer = await asyncio.open_connection(host, port)
                try:
                    writer.write(self._health)
                    status = await reader.readline()
                finally:
                    writer.close()
        except (OSError, TimeoutError) as exc:
            return False, type(exc).__name__
        if status.split(b" ")[1:2] != [b"200"]:
            return False, status.decode(errors="replace").strip() or "no answer"
        return True, ""

    async def relay(
        self, client_reader: asyncio.StreamReader, client: asyncio.StreamWriter
    ) -> None:
        relayed = Relayed(client)
        self.make_room()
        self.open.add(relayed)
        try:
            await self._relay(relayed, client_reader, client)
        finally:
            self.open.discard(relayed)
            relayed.close()

    async def _relay(
        self, relayed: Relayed, client_reader: asyncio.StreamReader, client: asyncio.StreamWriter
    ) -> None:
        upstream = None
        for target in (self.proxy, self.primary) if self.via_proxy else (self.primary,):
            try:
                async with asyncio.timeout(CONNECT_TIMEOUT_S):
                    upstream = await asyncio.open_connection(*target)
                break
            except (OSError, TimeoutError):
                if target == self.proxy:
                    say("proxy refused a connection: it goes straight to the primary")
        if upstream is None:
            return
        up_reader, up_writer = upstream
        relayed.sides.append(up_writer)
        await asyncio.gather(
            _pipe(client_reader, up_writer, relayed),
            _pipe(up_reader, client, relayed),
            return_exceptions=True,
        )


async def _pipe(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, relayed: Relayed
) -> None:
    """One direction; when it ends (or breaks), the other side is closed too, and the
    other direction ends with it."""
    try:
        while data := await reader.read(READ_SIZE):
            relayed.last = time.monotonic()
            writer.write(data)
            await writer.drain()
    except OSError:
        writer.transport.abort()
    finally:
        writer.close()


class CannotStart(Exception):
    """Why the guard cannot start, in one line."""


async def serve(listen: tuple[str, int], guard: Guard) -> None:
    try:
        server = await asyncio.start_server(guard.relay, *listen)
    except OSError as exc:
        raise CannotStart(listen_error(exc, *listen)) from None
    answered, why = await guard.check()
    guard.via_proxy = answered
    say(
        f"listening on {listen[0]}:{listen[1]}; "
        + ("through the proxy" if answered else f"straight to the primary (proxy: {why})")
    )
    async with server:
        await asyncio.gather(server.serve_forever(), guard.watch(), guard.close_idle())


class GuardProcess(ManagedProcess):
    """The guard as a child process (tests, benchmarks): on a free port, in front of
    `proxy_port`, falling back to `primary` (host:port)."""

    name = "guard"
    health_path = "/spillover/health"  # relayed: healthy once the proxy behind answers

    def __init__(
        self, proxy_port: int, primary: str, log_dir: Path | None = None, extra_args=()
    ) -> None:
        super().__init__(log_dir=log_dir)
        self.proxy_port, self.primary = proxy_port, primary
        self.extra_args = list(extra_args)

    def argv(self) -> list[str]:
        return [
            sys.executable, "-m", "scripts.guard", "--listen", f"127.0.0.1:{self.port}",
            "--proxy", f"127.0.0.1:{self.proxy_port}", "--primary", self.primary,
            "--every-s", "0.2", "--timeout-s", "0.5", *self.extra_args,
        ]  # fmt: skip

    def said(self) -> list[str]:
        return self.log_path.read_text().splitlines()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--listen", type=address, default=("127.0.0.1", 8090),
        help="HOST:PORT the clients connect to (default 127.0.0.1:8090)",
    )  # fmt: skip
    parser.add_argument(
        "--proxy", type=address, default=("127.0.0.1", 8091),
        help="HOST:PORT of the spillover proxy, where clients go while it is healthy "
        "(default 127.0.0.1:8091)",
    )  # fmt: skip
    parser.add_argument(
        "--primary", type=address, default=("127.0.0.1", 8081),
        help="HOST:PORT of the primary server, where clients go while the proxy is down",
    )  # fmt: skip
    parser.add_argument(
        "--every-s", type=float, default=0.5, help="ask the proxy's health this often"
    )
    parser.add_argument(
        "--timeout-s", type=float, default=1.0, help="a health check slower than this fails"
    )
    parser.add_argument(
        "--fails", type=int, default=2, help="checks failed in a row before the primary takes over"
    )
    parser.add_argument(
        "--passes", type=int, default=2, help="checks passed in a row before the proxy takes back"
    )
    parser.add_argument(
        "--token-file", type=Path,
        help="the proxy's control token (spillover_control_token), for its health check",
    )  # fmt: skip
    parser.add_argument("--idle-s", type=float, default=IDLE_S, help="close idle connections")
    parser.add_argument(
        "--max-connections", type=int, default=None,
        help="at most this many connections (default: as many as the descriptors allow)",
    )  # fmt: skip
    parser.add_argument(
        "--public", action="store_true",
        help="allow a non-loopback --listen (run the proxy with spillover_control_local=false)",
    )  # fmt: skip
    args = parser.parse_args()
    try:
        guard = Guard(
            args.proxy, args.primary, args.every_s, args.timeout_s, args.fails, args.passes,
            token=token(args), idle_s=args.idle_s, max_connections=args.max_connections,
        )  # fmt: skip
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve(args.listen, guard))
    except CannotStart as exc:
        print(f"guard: {exc}", file=sys.stderr)
        sys.exit(CANNOT_START)


def token(args: argparse.Namespace) -> str:
    """The control token the health check carries ('' for none), once the listening
    address is allowed."""
    if not is_loopback(args.listen[0]) and not args.public:
        raise CannotStart(
            "a non-loopback --listen makes every client look local to the proxy: "
            "add --public, run the proxy with --set spillover_control_local=false and a "
            "spillover_control_token, and give the guard that token with --token-file"
        )
    if args.token_file is None:
        return ""
    try:
        lines = args.token_file.read_text().splitlines()
    except OSError as exc:
        why = f"cannot read the token file {args.token_file} ({exc.strerror})"
        raise CannotStart(why) from None
    return lines[0].strip() if lines else ""


if __name__ == "__main__":
    main()
