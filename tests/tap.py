"""A TCP relay in front of a real server that acts when the server's answer reaches a
given point: a client behind the proxy cannot count the chunks of a tool call (the proxy
sends a call whole), so the cut inside one is landed here, on the server's own bytes.
It can also hold the proxy's requests of one kind: a server that hangs on one question,
which no real server does on demand."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress

from scripts.parts.processes import free_port


class Tap:
    """Relays 127.0.0.1:`port` to `target_port`; once armed, calls `act` (once) when the
    server has sent `when(seen)` true, `seen` being every byte it sent since arming. The
    bytes that made it true are forwarded after `act` returns; armed with `dies=True`
    (`act` kills the server), nothing the server sent after the event that made it true
    is forwarded: on a loaded machine one read can hold the whole rest of the answer,
    written before the kill landed, and a server that died there never sent it."""

    def __init__(self, target_port: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._target = target_port
        self._armed: tuple[Callable[[bytes], bool], Callable[[], None], bool] | None = None
        self._seen = bytearray()
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self.held = 0  # requests held since `hold`
        self._holding: bytes | None = None
        self._closed = threading.Event()

    def arm(
        self, when: Callable[[bytes], bool], act: Callable[[], None], dies: bool = False
    ) -> None:
        with self._lock:
            self._seen.clear()
            self._armed = (when, act, dies)

    def hold(self, start: bytes) -> None:
        """From now on, each request that begins with `start` waits at the tap (counted
        in `held`) until the tap closes: never answered."""
        with self._lock:
            self.held = 0
            self._holding = start

    @property
    def seen(self) -> bytes:
        """What the server has sent since the tap was armed, while it is."""
        with self._lock:
            return bytes(self._seen)

    def serve(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self._target))
            except OSError:  # the server is gone: so is this connection
                client.close()
                continue
            threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()

    def close(self) -> None:
        self._listener.close()
        self._closed.set()

    def _pipe(self, source: socket.socket, sink: socket.socket, answers: bool) -> None:
        try:
            while data := source.recv(65536):
                if not answers:
                    self._asked(data)
                cut = self._watch(data) if answers else None
                sink.sendall(data if cut is None else data[:cut])
                if cut is not None:
                    return  # the server died there
        except OSError:
            pass
        finally:
            # The close is passed on one way, as a TCP relay does: what the other side
            # still sends (a server's last bytes after its client closed) is read, and
            # seen, until it closes in turn.
            with suppress(OSError):
                sink.shutdown(socket.SHUT_WR)

    def _asked(self, data: bytes) -> None:
        """Hold what the proxy sent here while it is a request to hold."""
        with self._lock:
            if self._holding is None or not data.startswith(self._holding):
                return
            self.held += 1
        self._closed.wait()

    def _watch(self, data: bytes) -> int | None:
        """Where to cut `data` (a server that dies), or None to forward it all."""
        with self._lock:
            if self._armed is None:
                return None
            before = bytes(self._seen)
            self._seen += data
            when, act, dies = self._armed
            if not when(bytes(self._seen)):
                return None
            self._armed = None
        act()
        if not dies:
            return None
        # The first event boundary at which it held: what the server sent up to there.
        at = data.find(b"\n\n")
        while at >= 0 and not when(before + data[: at + 2]):
            at = data.find(b"\n\n", at + 2)
        return len(data) if at < 0 else at + 2


@contextmanager
def tapped(target_port: int) -> Iterator[Tap]:
    tap = Tap(target_port)
    threading.Thread(target=tap.serve, daemon=True).start()
    try:
        yield tap
    finally:
        tap.close()
