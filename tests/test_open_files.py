"""Many answers at once are not refused for want of descriptors: a real mitmdump with the
addon, started with a soft limit of 256 open files (as systemd's 1,024 for a service,
scaled down), raises it to its hard limit and carries 200 answers at once from a
stand-in upstream (it serves any number of paced answers on demand); plain mitmdump,
started the same way, runs out and answers 502."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from scripts.bench.paced import paced_streams
from scripts.bench.splice import SseSource
from scripts.parts.processes import running
from scripts.testbed.mitm import Mitmdump

ANSWERS = 200  # two descriptors each: more than a limit of 256 holds


def limited(tmp_path: Path, soft: int, hard: int) -> Path:
    """A mitmdump that starts with these limits on open files."""
    program = tmp_path / f"mitmdump-{soft}-{hard}"
    mitmdump = Path(sys.executable).parent / "mitmdump"
    program.write_text(
        f"#!{sys.executable}\nimport os, resource, sys\n"
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard}))\n"
        f"os.execv({str(mitmdump)!r}, [{str(mitmdump)!r}, *sys.argv[1:]])\n"
    )
    program.chmod(0o755)
    return program


def soft_limit(pid: int) -> int:
    (line,) = [s for s in Path(f"/proc/{pid}/limits").read_text().splitlines() if "open files" in s]
    return int(line.split()[3])


def answers_through(proxy: Mitmdump) -> int:
    """How many of ANSWERS paced answers asked at once came whole."""
    try:
        _, _, each, _ = asyncio.run(paced_streams(proxy.port, ANSWERS, 20, 1.0))
    except AssertionError as refused:  # the client's check of the head: a 502
        assert b"502" in refused.args[0], refused
        return 0
    return sum(1 for stream in each if len(stream) >= 20)


def test_the_proxy_raises_its_open_files_limit_and_carries_hundreds_of_answers(
    tmp_path: Path,
) -> None:
    source = SseSource(log_dir=tmp_path)
    with running(source):
        program = limited(tmp_path, 256, 4096)
        proxy = Mitmdump(source.url, [], mitmdump=program, log_dir=tmp_path)
        with running(proxy):
            assert soft_limit(proxy.pid) == 4096
            assert "open files limit 256 raised to 4096" in proxy.log_tail(200)
            files = proxy.status()["open_files"]
            assert files == {"limit": 4096, "started_with": 256, "answers_at_once": 2016}
            assert answers_through(proxy) == ANSWERS
        plain = Mitmdump(source.url, [], addon=False, mitmdump=program, log_dir=tmp_path)
        with running(plain):
            assert soft_limit(plain.pid) == 256
            assert answers_through(plain) < ANSWERS  # as it was without the raise


def test_a_hard_limit_too_low_for_many_answers_is_said(tmp_path: Path) -> None:
    source = SseSource(log_dir=tmp_path)
    with running(source):
        program = limited(tmp_path, 256, 1024)
        proxy = Mitmdump(source.url, [], mitmdump=program, log_dir=tmp_path)
        with running(proxy):
            assert proxy.status()["open_files"]["answers_at_once"] == 480
            said = proxy.log_tail(200)
            assert "about 480 answers at once fit in this process's open files limit" in said
            assert "(1024, hard limit 1024): raise the hard limit" in said
