"""Docker, for the container quick start (docs/your-cards.md): Debian's `docker.io`, its
daemon started where none answers (as root, with the `vfs` storage driver, which needs no
overlay support, and without touching the firewall: docker-proxy publishes the ports, and
the transparent-mode tests' nftables rules stay the only ones), and an image of the
llama-server the setup found. No registry is reachable from the test machines, so the
image is built FROM scratch: that binary and the libraries it links, nothing else.

    python -m scripts.testbed.containers    # install docker.io if need be, try the daemon
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.testbed.debian import apt_install

IMAGE = "spillover-testbed/llama-server"


class DockerUnavailable(RuntimeError):
    """Containers cannot run here; the message says why."""


def docker(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)


def ensure_installed() -> None:
    if shutil.which("docker") and shutil.which("dockerd"):
        return
    if not apt_install("docker.io") or not shutil.which("docker"):
        raise DockerUnavailable("no docker here (as root, scripts/setup.sh installs docker.io)")


def _answers() -> bool:
    return docker("info", "--format", "{{.ServerVersion}}", timeout=30).returncode == 0


def start_daemon(log: Path) -> subprocess.Popen | None:
    """The daemon this call started (stop it with `stop_daemon`), or None where one was
    already answering."""
    ensure_installed()
    if _answers():
        return None
    if os.geteuid() != 0:
        raise DockerUnavailable("no docker daemon answers, and only root may start one")
    with log.open("ab") as out:
        daemon = subprocess.Popen(
            ["dockerd", "--storage-driver=vfs", "--iptables=false", "--ip6tables=false"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            break
        if _answers():
            return daemon
        time.sleep(0.5)
    stop_daemon(daemon)
    tail = log.read_text(errors="replace")[-1500:]
    raise DockerUnavailable(f"dockerd does not start here:\n{tail}")


def stop_daemon(daemon: subprocess.Popen) -> None:
    if daemon.poll() is None:
        os.killpg(daemon.pid, signal.SIGTERM)
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(daemon.pid, signal.SIGKILL)
            daemon.wait()


def llama_server_image(binary: Path) -> str:
    """The tag of an image whose entry point is `binary` (built once per binary)."""
    tag = f"{IMAGE}:{hashlib.sha256(binary.read_bytes()).hexdigest()[:12]}"
    if docker("image", "inspect", tag).returncode == 0:
        return tag
    linked = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=True)
    with tempfile.TemporaryDirectory() as context:
        root = Path(context)
        shutil.copy2(binary, root / "llama-server")
        for library in re.findall(r"(/\S+) \(0x", linked.stdout):
            (root / library.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(Path(library).resolve(), root / library.lstrip("/"))
        (root / "Dockerfile").write_text('FROM scratch\nCOPY . /\nENTRYPOINT ["/llama-server"]\n')
        built = docker("build", "-q", "-t", tag, context, timeout=300)
        if built.returncode != 0:
            raise DockerUnavailable(f"the image does not build: {built.stderr[-1500:]}")
    return tag


if __name__ == "__main__":
    try:
        started = start_daemon(Path(tempfile.gettempdir()) / "spillover-dockerd.log")
    except DockerUnavailable as why:
        print(f"containers: not used: {why}", file=sys.stderr)
        raise SystemExit(1) from None
    if started is not None:
        stop_daemon(started)
    print("containers: docker runs here")
