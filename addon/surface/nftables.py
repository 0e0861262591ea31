"""The kernel's redirect rules, through nftables' own library (Debian: `libnftables1`).

The rules go in a table flagged `owner`: the kernel ties it to the netlink socket of the
process that made it, and deletes it when that socket closes. A proxy that stops, fails
or is SIGKILLed therefore leaves no rule behind, with nothing of ours left to clean up.
Owner tables need Linux 5.12 and nftables 0.9.9 or later; adding the rules needs
CAP_NET_ADMIN.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import ipaddress
import os
from dataclasses import dataclass
from urllib.parse import urlsplit

from addon.servers.addresses import address_of, is_local
from addon.servers.upstream import Upstream


class NftablesError(RuntimeError):
    pass


class Nftables:
    """One libnftables context; the tables it makes live as long as it does."""

    def __init__(self) -> None:
        name = ctypes.util.find_library("nftables") or "libnftables.so.1"
        try:
            lib = ctypes.CDLL(name)
        except OSError as exc:
            raise NftablesError(
                "nftables' library is missing (apt-get install libnftables1 nftables)"
            ) from exc
        lib.nft_ctx_new.restype = ctypes.c_void_p
        lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
        for name in ("nft_ctx_buffer_output", "nft_ctx_buffer_error", "nft_ctx_free"):
            getattr(lib, name).argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_error_buffer.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
        lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        self._lib = lib
        before = _open_descriptors()
        self._ctx = lib.nft_ctx_new(0)
        # Its netlink socket (the tables' owner) is made without close-on-exec: a program
        # this process started would hold it, and the rules, past this process's end.
        for descriptor, _ in _open_descriptors() - before:
            with contextlib.suppress(OSError):
                os.set_inheritable(descriptor, False)
        lib.nft_ctx_buffer_output(self._ctx)
        lib.nft_ctx_buffer_error(self._ctx)

    def run(self, commands: str) -> None:
        """Run nft commands as one transaction: all of them take effect, or none."""
        if self._lib.nft_run_cmd_from_buffer(self._ctx, commands.encode()) != 0:
            error = self._lib.nft_ctx_get_error_buffer(self._ctx) or b""
            raise NftablesError(error.decode(errors="replace").strip() or "nft failed")

    def close(self) -> None:
        """Free the context; its owner tables go with it."""
        if self._ctx is not None:
            self._lib.nft_ctx_free(self._ctx)
            self._ctx = None


def _open_descriptors() -> set[tuple[int, str]]:
    """This process's descriptors with what each is (the listing's own is gone by then)."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            found.add((int(name), os.readlink(f"/proc/self/fd/{name}")))
    return found


@dataclass(frozen=True)
class Redirect:
    """Connections to `address`:`port` (any address of this machine when `address` is
    local) go to this machine's `to_port` instead: from other machines and namespaces
    (prerouting), and from local processes of any user but `exempt_uid` (output), the
    proxy's own, whose connections to the server must reach it."""

    table: str
    address: str
    port: int
    to_port: int
    exempt_uid: int

    def ruleset(self) -> str:
        if is_local(self.address):
            where = "fib daddr type local"
        else:
            family = "ip6" if ipaddress.ip_address(self.address).version == 6 else "ip"
            where = f"{family} daddr {self.address}"
        match = f"{where} tcp dport {self.port}"
        redirect = f"redirect to :{self.to_port}"
        return (
            f"table inet {self.table} {{\n"
            "  flags owner\n"
            "  chain from_elsewhere {\n"
            "    type nat hook prerouting priority -100; policy accept;\n"
            f"    {match} {redirect}\n"
            "  }\n"
            "  chain from_here {\n"
            "    type nat hook output priority -100; policy accept;\n"
            f"    meta skuid != {self.exempt_uid} {match} {redirect}\n"
            "  }\n"
            "}\n"
        )


def redirect_to(primary: str, to_port: int) -> Redirect:
    """The rules that send connections for the `primary` URL's address and port to this
    machine's `to_port`, sparing this process's user."""
    if not (host := urlsplit(primary).hostname):
        raise ValueError(f"no server named in {primary!r}")
    port = Upstream(primary).port
    return Redirect(f"spillover_{os.getpid()}", address_of(host), port, to_port, os.geteuid())


def owner_tables_work() -> str | None:
    """Why this machine cannot hold owner tables (None: it can): made and dropped at once."""
    try:
        nft = Nftables()
    except NftablesError as exc:
        return str(exc)
    try:
        nft.run("table inet spillover_doctor { flags owner\n}\n")
        nft.run("delete table inet spillover_doctor\n")
    except NftablesError as exc:
        return f"nftables refused an owner table: {exc.args[0].splitlines()[0]}"
    finally:
        nft.close()
    return None
