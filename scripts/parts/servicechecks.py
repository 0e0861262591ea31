"""What `services install` checks before it writes anything, each problem in one line.

Given addresses that contradict each other (the guard's or the proxy's port a server's
own) are refused always. What this machine says now (a port taken, a command the
service user may not run, a settings file it may not read) is refused too, but with
`--no-start` only said: the files may be meant for later, or for another machine.
"""

from __future__ import annotations

import sys
from pathlib import Path

import scripts
from addon.servers.keyed import PARSERS, keyed_mistakes
from addon.servers.urlchecks import server_mistakes
from scripts.parts.access import READ, RUN, User, cannot_use
from scripts.parts.config import Config
from scripts.parts.ports import address, cannot_listen, clash, same_socket

SYSTEM_WIDE = (
    "install spillover where every user may run it (python3.12 -m venv /opt/spillover; "
    "docs/setup.md, 'A system-wide install') and run that one's `spillover services install`"
)


def listeners(listen: str, proxy_port: int, guarded: bool) -> dict[str, tuple[str, int]]:
    """What the units listen on: the clients' address, and the proxy's behind the guard."""
    taken = {"--listen": address(listen)}
    if guarded:
        taken["--proxy-port"] = ("127.0.0.1", proxy_port)
    return taken


def wrong_servers(servers: list[str], config: Config) -> list[str]:
    """The servers' URLs, and the settings file's options that name servers, checked as
    `spillover run` and the addon check them."""
    primary, *fallbacks = servers
    named = {name: value for name in PARSERS if (value := config.option(name)) is not None}
    return server_mistakes([primary], fallbacks, []) or keyed_mistakes(
        named, [url.rstrip("/") for url in servers]
    )


def contradictions(mine: dict[str, tuple[str, int]], servers: list[str]) -> list[str]:
    """The addresses given that cannot all be had."""
    found = []
    for flag, (host, port) in mine.items():
        if (server := clash((host, port), servers)) is not None:
            found.append(
                f"{flag} {host}:{port} is the server {server}'s own address: choose another"
            )
    if len(mine) == 2 and same_socket(*mine.values()):
        found.append("--listen and --proxy-port name one port: the guard and the proxy need two")
    return found


def on_this_machine(
    mine: dict[str, tuple[str, int]],
    ours: tuple[str, ...],
    run_as: User | None,
    command: Path,
    settings: Path | None = None,
) -> list[str]:
    """What stands in the way here now: taken ports (ones `ours`, the units being
    written, hold are taken back), a `command` that `run_as` may not run, and a
    `settings` file (a person's, not written by install) it may not read."""
    found = [
        f"{flag}: {why}" for flag, place in mine.items() if (why := cannot_listen(*place, ours))
    ]
    if run_as is None:
        return found
    if (why := cannot_use(run_as, needs(command))) is not None:
        found.append(f"{why}, so the units would not start (203/EXEC): {SYSTEM_WIDE}")
    if settings is not None and (why := cannot_use(run_as, {settings: READ})) is not None:
        found.append(
            f"{why}, so the proxy could not read its settings: put the file where "
            f"{run_as.name} may read it (such as the services' folder, --config-dir)"
        )
    return found


def needs(command: Path) -> dict[Path, int]:
    """What a unit's `spillover` command opens as it starts: itself (a script), the
    Python it names (this one: it is beside it), and the folder the project's code is in."""
    return {
        command: READ | RUN,
        Path(sys.executable): RUN,
        Path(scripts.__file__).resolve().parent.parent: READ | RUN,
    }
