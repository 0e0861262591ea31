"""Who holds a server's port, looked up again and again (watchers/listeners.py): after the
first lookup reads every process's descriptors, a later one reads those of the processes
that held the port's socket and of those started since, and reads them all again when a
holder is gone or the socket is another one. Through real processes and the real /proc,
and through a tree of real files standing in for /proc."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from scripts.testbed.memfiles import FakeProcess
from tests.listener import listening_process
from watchers.listeners import ListenerScans, find_listeners

PORT = 8081
INODE = 900001


def test_a_server_started_again_on_its_port_is_found() -> None:
    scans = ListenerScans()
    with listening_process() as (first, port):
        assert scans.find(port).pids == {first}
        # Looked up again, as a whole walk finds it (with any process not ours to read).
        assert scans.find(port) == find_listeners(port)
    again = f"import socket, sys; s = socket.create_server(('127.0.0.1', {port})); "
    again += "print(1, flush=True); sys.stdin.read()"
    server = subprocess.Popen(
        [sys.executable, "-c", again], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None and server.stdout.readline()
        assert scans.find(port).pids == {server.pid}
    finally:
        server.kill()
        server.wait()
    assert not scans.find(port).listening


def test_a_process_started_with_the_socket_is_found(tmp_path: Path) -> None:
    """A worker the server started and gave its socket (a process new since the last
    lookup) holds it too."""
    proc = machine(tmp_path)
    scans = ListenerScans(proc)
    assert scans.find(PORT).pids == {100}
    FakeProcess(proc, 300, "worker").open(f"socket:[{INODE}]")
    assert scans.find(PORT).pids == {100, 300}
    assert scans.find(PORT) == find_listeners(PORT, proc)


def test_only_holders_and_new_processes_are_read_until_a_holder_goes(tmp_path: Path) -> None:
    """A process that was there before and held no socket of the port is not read again
    (only descriptor passing could give it one); once a holder is gone, all are."""
    proc = machine(tmp_path)
    scans = ListenerScans(proc)
    assert scans.find(PORT).pids == {100}
    passed = FakeProcess(proc, 205, "other")
    passed.open(f"socket:[{INODE}]")  # given the socket over a UNIX socket, say
    assert scans.find(PORT).pids == {100}
    for fd in (proc / "100" / "fd").iterdir():
        fd.unlink()
    (proc / "100" / "fd").rmdir()  # the server is gone; its socket lives on in 205
    assert scans.find(PORT).pids == {205}


def test_a_socket_listening_again_is_looked_for_everywhere(tmp_path: Path) -> None:
    proc = machine(tmp_path)
    scans = ListenerScans(proc)
    assert scans.find(PORT).pids == {100}
    (proc / "net" / "tcp").write_text((proc / "net" / "tcp").read_text().replace(str(INODE), "7"))
    # The server listens again, and so does a process that was there before (the new
    # socket's, say, to hand to the server: socket activation)
    FakeProcess(proc, 100).open("socket:[7]")
    FakeProcess(proc, 210, "other").open("socket:[7]")
    assert scans.find(PORT).pids == {100, 210}


def machine(tmp_path: Path) -> Path:
    """A /proc of a server (pid 100) listening on PORT among twenty other processes."""
    proc = tmp_path / "proc"
    FakeProcess(proc, 100).listen(PORT, INODE)
    for pid in range(200, 220):
        other = FakeProcess(proc, pid, "other")
        other.open("/dev/null")
        other.open(f"socket:[{5000 + pid}]")
    return proc


def test_a_port_nobody_listens_on_is_not_listening() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))  # bound, not listening
        assert not ListenerScans().find(sock.getsockname()[1]).listening
