"""Docker, for the container quick start (docs/your-cards.md): Debian's `docker.io`, its
daemon started where none answers (as root, with the `vfs` storage driver, which needs no
overlay support, and without touching the firewall: docker-proxy publishes the ports, and
the transparent-mode tests' nftables rules stay the only ones), and an image of the
llama-server the setup found. No registry is reachable from the test machines, so the
image is built FROM scratch: that binary and the libraries it links, nothing else.

    python -m scripts.testbed.containers    # install docker.io if need be, start the daemon
"""

from __future__ import annotations

import fcntl
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
# Where containers mount what they use; a scratch image must have them as folders.
MOUNT_POINTS = ("etc", "usr", "run", "tmp", "proc", "sys", "dev", "root", "srv", "var/log")


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


def ensure_daemon() -> None:
    """A docker daemon that answers: started where none does (and left running, as a
    machine's own would be; one start at a time across the tests' workers)."""
    ensure_installed()
    with open(Path(tempfile.gettempdir()) / "spillover-dockerd.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _answers():
            return
        if os.geteuid() != 0:
            raise DockerUnavailable("no docker daemon answers, and only root may start one")
        log = Path(tempfile.gettempdir()) / "spillover-dockerd.log"
        with log.open("ab") as out:
            daemon = subprocess.Popen(
                ["dockerd", "--storage-driver=vfs", "--iptables=false", "--ip6tables=false"],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and daemon.poll() is None:
            if _answers():
                return
            time.sleep(0.5)
        if daemon.poll() is None:
            os.killpg(daemon.pid, signal.SIGKILL)
        tail = log.read_text(errors="replace")[-1500:]
        raise DockerUnavailable(f"dockerd does not start here:\n{tail}")


def _image(tag: str, files: dict[str, Path], links: dict[str, str], entry: str = "") -> str:
    """`tag`, built FROM scratch once: `files` (path in the image: file here), `links`
    (path: where it points) and empty folders for the mounts."""
    if docker("image", "inspect", tag).returncode == 0:
        return tag
    with tempfile.TemporaryDirectory() as context:
        root = Path(context)
        for inside, source in files.items():
            (root / inside).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, root / inside)
        for inside, target in links.items():
            (root / inside).symlink_to(target)
        for folder in MOUNT_POINTS:
            (root / folder).mkdir(parents=True, exist_ok=True)
        dockerfile = "FROM scratch\nCOPY . /\n" + (f'ENTRYPOINT ["{entry}"]\n' if entry else "")
        (root / "Dockerfile").write_text(dockerfile)
        built = docker("build", "-q", "-t", tag, context, timeout=300)
        if built.returncode != 0:
            raise DockerUnavailable(f"{tag} does not build: {built.stderr[-1500:]}")
    return tag


def llama_server_image(binary: Path) -> str:
    """The tag of an image whose entry point is `binary`, with the libraries it links,
    each where it is here: a binary that finds its libraries beside itself ($ORIGIN in
    its run path, as the prebuilt llama-server's does) finds them there too."""
    linked = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=True)
    files = {str(binary).lstrip("/"): binary}
    for library in re.findall(r"(/\S+) \(0x", linked.stdout):
        files[library.lstrip("/")] = Path(library).resolve()
    tag = f"{IMAGE}:{hashlib.sha256(binary.read_bytes()).hexdigest()[:12]}-{len(files)}"
    return _image(tag, files, {}, entry=str(binary))


def systemd_image() -> str:
    """The tag of an image that boots this machine's own systemd: empty but for the
    links a merged /usr needs; /usr and /etc are mounted from this machine, read-only."""
    if not Path("/lib/systemd/systemd").exists():
        raise DockerUnavailable("no systemd installed here")
    links = {name: f"usr/{name}" for name in ("bin", "sbin", "lib", "lib64")}
    if any(not Path(f"/{name}").is_symlink() for name in links):
        raise DockerUnavailable("this machine's / is not a merged /usr (its /bin is a folder)")
    return _image(f"{IMAGE.rsplit('/', 1)[0]}/systemd:1", {}, links)


if __name__ == "__main__":
    try:
        ensure_daemon()
    except DockerUnavailable as why:
        print(f"containers: not used: {why}", file=sys.stderr)
        raise SystemExit(1) from None
    print("containers: docker runs here")
