"""Whether this machine lets the proxy take clients' connections without their changing
anything, and why not (for `spillover doctor` and the tests).

- `spillover run --transparent`: nftables rules in an owner table (addon/surface/
  nftables.py), which need CAP_NET_ADMIN, nftables' library, and Linux 5.12 or later.
- `spillover run --capture PROGRAMS`: mitmproxy's local capture mode, whose Linux
  redirector is started through sudo (even by root), attaches eBPF programs to the
  cgroup v2 hierarchy at /sys/fs/cgroup, and needs root there.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

from addon.surface.nftables import owner_tables_work

CAP_NET_ADMIN = 12
CGROUP_ROOT = "/sys/fs/cgroup"


def transparent_why_not() -> str | None:
    if not _has_capability(CAP_NET_ADMIN):
        return "needs CAP_NET_ADMIN (root, or AmbientCapabilities=CAP_NET_ADMIN in its unit)"
    return owner_tables_work()


def local_capture_why_not() -> str | None:
    if importlib.util.find_spec("mitmproxy_linux") is None:
        return "mitmproxy's Linux redirector (the mitmproxy_linux package) is not installed"
    if os.geteuid() != 0:
        return "needs root (mitmproxy starts its redirector through sudo)"
    if shutil.which("sudo") is None:
        return "needs sudo: mitmproxy starts its redirector through it, even as root"
    if (where := cgroup2_mount()) != CGROUP_ROOT:
        found = f"it is mounted at {where} (a hybrid layout)" if where else "none is mounted"
        return (
            f"the redirector attaches to the cgroup v2 hierarchy at {CGROUP_ROOT}, and {found}; "
            "a unified layout (systemd.unified_cgroup_hierarchy=1) provides it"
        )
    return None


def cgroup2_mount(mounts: Path = Path("/proc/self/mounts")) -> str | None:
    """Where the cgroup v2 hierarchy is mounted (the mount at /sys/fs/cgroup first)."""
    found = [line.split()[1] for line in mounts.read_text().splitlines()
             if len(line.split()) > 2 and line.split()[2] == "cgroup2"]  # fmt: skip
    return CGROUP_ROOT if CGROUP_ROOT in found else (found[0] if found else None)


def _has_capability(bit: int) -> bool:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> bit & 1)
    return False
