"""The fleet's telemetry for the remote-card tests and benchmark: Debian's Prometheus and
node_exporter (`apt-get install prometheus prometheus-node-exporter`; scripts/setup.sh
does), each a child process on a loopback address that stands for a host of its own."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from scripts.parts.processes import ManagedProcess, ServerFailed
from scripts.testbed.debian import apt_install

NODE_EXPORTER = "prometheus-node-exporter"
PROMETHEUS = "prometheus"


def binary(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise ServerFailed(f"{name} is not installed (apt-get install {name})")
    return found


def not_installed() -> str | None:
    missing = [name for name in (PROMETHEUS, NODE_EXPORTER) if shutil.which(name) is None]
    return f"not installed: apt-get install {' '.join(missing)}" if missing else None


def ensure_installed() -> str | None:
    """Install Prometheus and node_exporter where missing and this process may; None
    when both are there, else why not."""
    if (why := not_installed()) is not None:
        print(f"{why} (the fleet tests' telemetry)")
        apt_install(PROMETHEUS, NODE_EXPORTER)
    return not_installed()


class NodeExporter(ManagedProcess):
    """node_exporter with only its drm collector, reading a tree of real amdgpu files."""

    name = "node-exporter"
    health_path = "/metrics"

    def __init__(self, sysfs: Path, **kwargs) -> None:
        super().__init__(**kwargs)
        self.sysfs = sysfs

    def argv(self) -> list[str]:
        return [
            binary(NODE_EXPORTER), f"--web.listen-address={self.host}:{self.port}",
            "--collector.disable-defaults", "--collector.drm", f"--path.sysfs={self.sysfs}",
        ]  # fmt: skip


class Prometheus(ManagedProcess):
    """A Prometheus scraping `targets` ("host:port" or "host:port/path") every `every_s`."""

    name = "prometheus"
    health_path = "/-/ready"

    def __init__(self, targets: Sequence[str], every_s: float = 1.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.dir = Path(tempfile.mkdtemp(prefix="spillover-prometheus-"))
        jobs = []
        for n, target in enumerate(targets):
            address, _, path = target.partition("/")
            jobs.append(
                f"  - job_name: target{n}\n    metrics_path: /{path or 'metrics'}\n"
                f"    static_configs: [{{targets: ['{address}']}}]\n"
            )
        interval = f"{int(every_s * 1000)}ms"
        (self.dir / "prometheus.yml").write_text(
            f"global: {{scrape_interval: {interval}, scrape_timeout: {interval}}}\n"
            "scrape_configs:\n" + "".join(jobs)
        )

    def argv(self) -> list[str]:
        return [
            binary(PROMETHEUS),
            f"--config.file={self.dir / 'prometheus.yml'}",
            f"--storage.tsdb.path={self.dir / 'data'}",
            f"--web.listen-address={self.host}:{self.port}",
        ]

    def stop(self) -> None:
        super().stop()
        shutil.rmtree(self.dir, ignore_errors=True)


if __name__ == "__main__":
    if (why := ensure_installed()) is not None:
        raise SystemExit(why)
