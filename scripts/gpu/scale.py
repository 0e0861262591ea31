"""The workers at scale on a lent machine: `scripts.bench.paced` with `--workers` rows,
on a machine with no package index, from the bundle (`scripts/gpu/bundle.sh`: the wheels,
and HAProxy's Debian package with the libraries it needs beside it).

    python3 -m scripts.gpu.scale --wheels gpu-bundle [--streams 256,1024,4096]
        [--workers 2,4,8,16] [--seconds 4]

The wheels are installed into the cache as the GPU proof installs them. HAProxy is the
machine's own where it has one; otherwise the bundle's packages are unpacked into the
cache (a .deb is an `ar` archive holding a tar of its files; nothing is installed on the
system) and run by a wrapper that gives only HAProxy their libraries. Beside a link to
this Python go a `mitmdump` command (none comes with wheels installed by --target), and
the bench runs from there, so the proxies it starts find mitmdump beside their Python.
What the bench prints is also written to $OUT/scale.txt where $OUT is set.
"""

from __future__ import annotations

import argparse
import io
import os
import site
import subprocess
import sys
import tarfile
from pathlib import Path

from scripts.gpu.prepare import REPO, activate, install_wheels
from scripts.gpu.testbed import MITMDUMP
from scripts.testbed.llamabin import CACHE

# HAProxy's package and the libraries it links that a machine may lack (Debian 12's).
PACKAGES = ("haproxy", "liblua5.3-0", "libopentracing-c-wrapper0", "libopentracing1")
MULTIARCH = "usr/lib/x86_64-linux-gnu"


def deb_files(deb: Path, target: Path) -> None:
    """Unpack the files of a Debian package (its data.tar.*) into `target`."""
    data = deb.read_bytes()
    if not data.startswith(b"!<arch>\n"):
        raise ValueError(f"{deb.name} is not a Debian package")
    at = 8
    while at + 60 <= len(data):
        name = data[at : at + 16].decode().strip().rstrip("/")
        size = int(data[at + 48 : at + 58].decode().strip())
        body = data[at + 60 : at + 60 + size]
        if name.startswith("data.tar"):
            with tarfile.open(fileobj=io.BytesIO(body)) as tar:  # gz, xz or bz2
                tar.extractall(target, filter="tar")
            return
        at += 60 + size + size % 2  # members are padded to an even length
    raise ValueError(f"{deb.name} holds no data.tar")


def bundled_haproxy(bundle: Path, cache: Path = CACHE) -> Path:
    """A command that runs the bundle's HAProxy with the bundle's libraries (unpacked
    into the cache, again on each call: 2.2 MB)."""
    debs = {name: sorted(bundle.glob(f"{name}_*.deb")) for name in PACKAGES}
    if not debs["haproxy"]:
        raise FileNotFoundError(f"no haproxy_*.deb in {bundle} (scripts/gpu/bundle.sh)")
    root = cache / f"haproxy-{debs['haproxy'][-1].stem}"
    for found in debs.values():
        for deb in found:
            deb_files(deb, root)
    wrapper = root / "haproxy"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'LD_LIBRARY_PATH="{root / MULTIARCH}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}" '
        f'exec "{root / "usr/sbin/haproxy"}" "$@"\n'
    )
    wrapper.chmod(0o755)
    said = subprocess.run([wrapper, "-v"], capture_output=True, text=True)
    if said.returncode != 0 or "HAProxy version" not in said.stdout:
        raise RuntimeError(f"the bundle's HAProxy does not run here: {said.stderr.strip()}")
    return wrapper


def python_with_mitmdump(cache: Path = CACHE) -> Path:
    """This Python, by a link in a folder of its own beside a `mitmdump` command."""
    folder = cache / "scale-bin"
    folder.mkdir(parents=True, exist_ok=True)
    python = folder / "python3"
    python.unlink(missing_ok=True)  # (one made by another Python before)
    python.symlink_to(sys.executable)
    mitmdump = folder / "mitmdump"
    mitmdump.write_text(f"#!{python}\n{MITMDUMP.replace('; ', chr(10))}\n")
    mitmdump.chmod(0o755)
    return python


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", type=Path, help="the bundle (its wheels, HAProxy's debs)")
    parser.add_argument("--streams", default="256,1024,4096")
    parser.add_argument("--workers", default="2,4,8,16")
    parser.add_argument("--seconds", type=float, default=4)
    parser.add_argument("--bundled-haproxy", action="store_true",
                        help="the bundle's HAProxy even where the machine has one")  # fmt: skip
    args = parser.parse_args(argv)
    if args.wheels is not None and any(args.wheels.glob("*.whl")):
        activate(install_wheels(args.wheels))
    env = dict(os.environ)  # (activate named the wheels in PYTHONPATH)
    # Imported once the wheels are: the workers' pool imports the addon.
    from scripts.workers.pool import HaproxyMissing, haproxy_binary

    try:
        if args.bundled_haproxy:
            raise HaproxyMissing("asked for the bundle's")
        haproxy = Path(haproxy_binary())
    except HaproxyMissing:
        if args.wheels is None:
            raise
        haproxy = bundled_haproxy(args.wheels)
    env["SPILLOVER_HAPROXY"] = str(haproxy)
    python = python_with_mitmdump()
    env["PATH"] = f"{python.parent}:{env.get('PATH', '')}"
    # A venv's packages are found only by its own python's path: named for the link.
    paths = [*filter(None, env.get("PYTHONPATH", "").split(":")), *site.getsitepackages()]
    env["PYTHONPATH"] = ":".join(dict.fromkeys([str(REPO), *paths]))
    bench = [
        str(python), "-m", "scripts.bench.paced", "--streams", args.streams,
        "--workers", args.workers, "--seconds", str(args.seconds),
    ]  # fmt: skip
    print(f"scale: HAProxy {haproxy}; {' '.join(bench[1:])}", flush=True)
    ran = subprocess.run(bench, env=env, stdout=subprocess.PIPE, text=True)
    print(ran.stdout, end="")
    if out := os.environ.get("OUT"):
        (Path(out) / "scale.txt").write_text(ran.stdout)
    return ran.returncode


if __name__ == "__main__":
    sys.exit(main())
