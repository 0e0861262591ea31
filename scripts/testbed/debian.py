"""Debian packages the test bed needs, installed where this process may (root with
apt-get); elsewhere the caller says what to install."""

from __future__ import annotations

import os
import shutil
import subprocess


def apt_install(*packages: str) -> bool:
    """Install `packages` if this process may; False where it may not."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return False
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages]
    subprocess.run(install, check=True, env=env)
    return True
