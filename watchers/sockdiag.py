"""The TCP sockets listening in this network namespace, asked of the kernel over netlink
(sock_diag, what `ss -lt` reads): each one's port, owner and inode, filtered by state in
the kernel. /proc/net/tcp lists every socket instead, TIME_WAIT ones too: on a proxy's
host that is tens of thousands of lines, tens of milliseconds to read and parse."""

from __future__ import annotations

import socket
import struct

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
TCP_LISTEN = 10
_HEADER = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, sequence, port id
# inet_diag_req_v2: family, protocol, extensions, pad, states; then an inet_diag_sockid
# left zero (ports, addresses, interface, cookie: 48 bytes).
_REQUEST = struct.Struct("=BBBBI48x")
# inet_diag_msg: family, state, timer, retransmits; the sockid's source port (big-endian)
# and the rest of it; expires, read queue, write queue, uid, inode.
_MESSAGE = struct.Struct("=BBBB2s46xIIIII")


def listening() -> list[tuple[int, int, int]] | None:
    """(port, uid, inode) of every TCP socket listening here, IPv4 and IPv6; None where
    the kernel cannot be asked (no netlink sock_diag: a sandbox may forbid it)."""
    found: list[tuple[int, int, int]] = []
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as sock:
            for sequence, family in enumerate((socket.AF_INET, socket.AF_INET6), 1):
                request = _REQUEST.pack(family, socket.IPPROTO_TCP, 0, 0, 1 << TCP_LISTEN)
                header = _HEADER.pack(
                    _HEADER.size + len(request), SOCK_DIAG_BY_FAMILY,
                    NLM_F_REQUEST | NLM_F_DUMP, sequence, 0,
                )  # fmt: skip
                sock.sendall(header + request)
                if not _receive(sock, sequence, found):
                    return None
    except OSError:
        return None
    return found


def _receive(sock: socket.socket, sequence: int, found: list[tuple[int, int, int]]) -> bool:
    """Read one dump's answers into `found`; False where the kernel refused it."""
    while True:
        data = sock.recv(65536)
        if not data:
            return False
        at = 0
        while at + _HEADER.size <= len(data):
            length, kind, _, seq, _ = _HEADER.unpack_from(data, at)
            if length < _HEADER.size:
                return False
            if seq == sequence:
                if kind == NLMSG_DONE:
                    return True
                if kind == NLMSG_ERROR:
                    return False
                if kind == SOCK_DIAG_BY_FAMILY and length >= _HEADER.size + _MESSAGE.size:
                    fields = _MESSAGE.unpack_from(data, at + _HEADER.size)
                    state, port, uid, inode = fields[1], fields[4], fields[8], fields[9]
                    if state == TCP_LISTEN:
                        found.append((int.from_bytes(port, "big"), uid, inode))
            at += (length + 3) & ~3
