"""Network namespaces for tests that change the kernel's rules: a rule added inside one
never touches the machine's own traffic, and goes with the namespace.

`Netns.pair()` makes two namespaces joined by a veth link (a "server" side and a
"client" side, like a host and a container). `inside()` moves the calling thread into
one: the sockets it opens and the processes it starts from then on live there (a
network namespace belongs to each thread; children inherit their parent thread's).
Needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) and `ip` (iproute2).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

SERVER_ADDRESS, CLIENT_ADDRESS = "10.77.0.1", "10.77.0.2"
SERVER_ADDRESS6, CLIENT_ADDRESS6 = "fd77::1", "fd77::2"


def why_not() -> str | None:
    """Why this machine cannot make namespaces for a test (None: it can)."""
    if os.geteuid() != 0:
        return "needs root, to make network namespaces"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip`"
    return None


@dataclass
class Netns:
    name: str

    @classmethod
    def pair(cls) -> tuple[Netns, Netns]:
        """A server side at SERVER_ADDRESS and SERVER_ADDRESS6, a client side at
        CLIENT_ADDRESS and CLIENT_ADDRESS6."""
        tag = secrets.token_hex(3)
        server, client = cls(f"sp-srv-{tag}"), cls(f"sp-cli-{tag}")
        for side in (server, client):
            _ip("netns", "add", side.name)
            side.ip("link", "set", "lo", "up")
        _ip("link", "add", f"vs{tag}", "netns", server.name, "type", "veth",
            "peer", "name", f"vc{tag}", "netns", client.name)  # fmt: skip
        for side, link, address, address6 in (
            (server, f"vs{tag}", SERVER_ADDRESS, SERVER_ADDRESS6),
            (client, f"vc{tag}", CLIENT_ADDRESS, CLIENT_ADDRESS6),
        ):
            side.ip("addr", "add", f"{address}/24", "dev", link)
            # nodad: usable at once, not after duplicate address detection's second
            side.ip("-6", "addr", "add", f"{address6}/64", "dev", link, "nodad")
            side.ip("link", "set", link, "up")
        return server, client

    def ip(self, *args: str) -> None:
        _ip("-n", self.name, *args)

    def nft_ruleset(self) -> str:
        return subprocess.run(
            ["ip", "netns", "exec", self.name, "nft", "list", "ruleset"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        """The calling thread in this namespace until the block ends."""
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        there = os.open(f"/run/netns/{self.name}", os.O_RDONLY)
        try:
            os.setns(there, os.CLONE_NEWNET)
            yield
        finally:
            os.setns(home, os.CLONE_NEWNET)
            os.close(there)
            os.close(home)

    def delete(self) -> None:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)
