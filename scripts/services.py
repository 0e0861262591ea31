"""Run the proxy for real: systemd user services for the proxy and its fail-open guard.

The proxy (mitmdump with the addon) and the guard each get a unit; the proxy runs with
the settings file every command reads (scripts/parts/config.py), which a person edits.

    spillover services install --config spillover.yaml [--proxy-port 8091]
    spillover services install --primary http://127.0.0.1:8081 \\
        --fallbacks http://127.0.0.1:8082 [--listen 127.0.0.1:8090] [--proxy-port 8091]
    spillover services uninstall [--purge]

`install` takes the settings file `--config` names (or ./spillover.yaml), else keeps
`~/.config/spillover/spillover.yaml` or writes it from the flags
(`scripts.parts.serviceoptions`); the flags given win over the file. It writes
`spillover-proxy.service` (`spillover run --config FILE --confdir ~/.config/spillover`,
on the proxy's port behind the guard, restarted on failure) and `spillover-guard.service`
(`spillover guard` on the clients' address, the file's listen_host and port), both
running the installed command, in `~/.config/systemd/user/`, then enables and starts
both (`--no-start`: only writes), and says the address clients use. It first refuses
ports that are a server's or taken here, and, with `--system`, a command the service
user may not run or a settings file it may not read (`scripts.parts.servicechecks`);
where the servers' processes are another user's, it writes the cards it finds for them
(`scripts.parts.servicecards`).
A non-loopback `--listen` is public: the proxy then trusts no local client on its control
routes, and proxy and guard share a control token in `~/.config/spillover/control-token`
(made once, mode 0600), which the guard's health check carries.
`uninstall` stops and removes the services; `--purge` removes their folder (the settings
file install wrote, the token) too.
"""

from __future__ import annotations

import argparse
import os
import pwd
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from scripts.guard import CANNOT_START
from scripts.parts import servicechecks
from scripts.parts.access import User
from scripts.parts.config import HELP
from scripts.parts.ports import EVERY_ADDRESS, address, is_loopback
from scripts.parts.servicecards import cards_found
from scripts.parts.serviceoptions import (
    Settings,
    advise,
    move_aside,
    settings,
    settle,
    token_file,
    write,
)

UNITS = ("spillover-proxy.service", "spillover-guard.service")


def command() -> Path:
    """The installed `spillover` command, beside this Python (pip install puts it there)."""
    found = Path(sys.executable).parent / "spillover"
    if not found.exists():
        raise SystemExit(
            f"services: no spillover command beside {sys.executable}: install the project "
            "(pipx install or pip install, from a checkout, its git URL or a wheel) first"
        )
    return found


def config_home() -> Path:
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")


@dataclass(frozen=True)
class Manager:
    """How the service manager runs the units: a person's (user units: they run while
    that person is logged in, or from boot with `loginctl enable-linger`) or the
    machine's (system units: from boot, as `run_as`, after `after`, such as the
    engines' own units)."""

    system: bool = False
    run_as: str = "spillover"
    after: tuple[str, ...] = ()

    def unit(
        self, what: str, start: str, restart: str, capabilities: str = "", final: int = 0
    ) -> str:
        """`final`: an exit code that says restarting would not help."""
        order = " ".join(self.after)
        if self.system:
            order = f"Wants=network-online.target\nAfter=network-online.target {order}".rstrip()
        else:
            order = f"After={order}" if order else ""
        service = f"User={self.run_as}\n" if self.system and self.run_as != "root" else ""
        if capabilities:
            service += f"AmbientCapabilities={capabilities}\nCapabilityBoundingSet={capabilities}\n"
        if final:
            service += f"RestartPreventExitStatus={final}\n"
        return (
            f"[Unit]\nDescription=spillover {what}\n" + (f"{order}\n" if order else "") + "\n"
            f"[Service]\n{service}ExecStart={start}\nRestart={restart}\nRestartSec=1\n\n"
            f"[Install]\nWantedBy={'multi-user.target' if self.system else 'default.target'}\n"
        )


def proxy_unit(
    chosen: Settings, confdir: Path, manager: Manager, run: str, capabilities: str = ""
) -> str:
    """`run`: more `run` arguments (its address, workers behind HAProxy, the transparent
    mode); the flags install was given that the settings file does not say go too."""
    for name, value in chosen.flags.items():
        if value != chosen.config.get(name):
            print(
                f"services: WARNING: {chosen.path} does not name {value} as its {name}, given "
                f"now: the unit names it (the flags win over the file)"
            )
            run = f" --{name} {shlex.quote(value)}{run}"
    start = f"{command()} run --config {shlex.quote(str(chosen.path))} --confdir {confdir}{run}"
    return manager.unit("proxy: mitmdump with the spillover addon", start, "on-failure",
                        capabilities)  # fmt: skip


def guard_unit(
    listen: str, proxy_port: int, primary: str, token: Path | None, manager: Manager
) -> str:
    """`token`: the control token's file, where the guard is public."""
    target = primary.split("//", 1)[-1].rstrip("/")
    extra = f" --public --token-file {token}" if token else ""
    start = (
        f"{command()} guard --listen {listen} --proxy 127.0.0.1:{proxy_port} "
        f"--primary {target}{extra}"
    )
    return manager.unit(
        "guard: clients reach the primary when the proxy is down", start, "always",
        final=CANNOT_START,
    )  # fmt: skip


def systemctl(manager: Manager, *args: str) -> str | None:
    """Run `systemctl` (`--user` for a person's units); why it could not, or None."""
    if shutil.which("systemctl") is None:
        return "no systemctl here"
    scope = [] if manager.system else ["--user"]
    run = subprocess.run(["systemctl", *scope, *args], capture_output=True, text=True)
    if run.returncode != 0:
        said = (run.stderr or run.stdout).strip().splitlines()
        command = " ".join(["systemctl", *scope, args[0]])
        return f"{command} failed ({said[0] if said else run.returncode})"
    return None


def by_hand(units: Path) -> str:
    """How to start what the units start, without a service manager."""
    commands = []
    for unit in UNITS:
        if not (units / unit).exists():
            continue  # (the guard, with workers behind HAProxy)
        for line in (units / unit).read_text().splitlines():
            if line.startswith("ExecStart="):
                commands.append(line.removeprefix("ExecStart="))
    return "\n".join(f"    {started} &" for started in commands)


def places(args: argparse.Namespace) -> tuple[Path, Path]:
    """Where the options and the units go: the person's config home, or the machine's
    (/etc) with --system; --config-dir and --unit-dir choose others."""
    if args.system:
        return args.config_dir or Path("/etc/spillover"), args.unit_dir or Path(
            "/etc/systemd/system"
        )
    home = config_home()
    return args.config_dir or home / "spillover", args.unit_dir or home / "systemd" / "user"


def give_to_user(user: str, confdir: Path, create: bool) -> str | None:
    """Make `confdir` the system units' user's own: the proxy (mitmproxy) writes its
    certificate authority there, and the proxy and the guard read the control token,
    which only its owner may. That user is made where it is missing and `create` (a
    system user, no home, no shell). Why it could not be done, or None."""
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        make = ["useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent",
                "--shell", "/usr/sbin/nologin", user]  # fmt: skip
        if not create:
            return f"no user {user} here: `{' '.join(make)}` before starting the units"
        made = subprocess.run(make, capture_output=True, text=True)
        if made.returncode != 0:
            return f"could not make the user {user} ({made.stderr.strip()}): make it, then start"
        print(f"services: made the system user {user}")
        entry = pwd.getpwnam(user)
    try:
        for path in [confdir, *confdir.rglob("*")]:
            os.chown(path, entry.pw_uid, entry.pw_gid)
    except PermissionError:
        return f"{confdir} is not {user}'s own: `sudo chown -R {user}: {confdir}`"
    return None


def install(args: argparse.Namespace) -> None:
    confdir, units = places(args)
    manager = Manager(args.system, args.run_as, tuple(filter(None, args.after.split(","))))
    if args.transparent and not args.system:
        raise SystemExit(
            "services: --transparent changes the kernel's rules (CAP_NET_ADMIN): a system "
            "service only (--system)"
        )
    chosen = settings(args, confdir)
    settle(args, chosen)
    routed = bool(args.workers or args.transparent)
    servers = [args.primary, *(url.strip() for url in args.fallbacks.split(",") if url.strip())]
    if wrong := servicechecks.wrong_servers(servers, chosen.config):
        raise SystemExit("\n".join(f"services: {problem}" for problem in wrong))
    service_user = User.named(args.run_as) if args.system and args.run_as != "root" else None
    check(args, servers, routed, service_user, None if chosen.keys is not None else chosen.path)
    confdir.mkdir(parents=True, exist_ok=True)
    units.mkdir(parents=True, exist_ok=True)
    public = not routed and not is_loopback(address(args.listen)[0])
    token = token_file(chosen, confdir) if public else None
    cards = cards_found(service_user, servers, chosen.path)
    if chosen.keys is not None:
        write(chosen, address(args.listen), behind(args), token, cards)
    else:
        advise(chosen, token, cards)
    if chosen.old is not None:
        move_aside(chosen.old)
    if routed:
        # HAProxy, or the kernel's rules (gone with the proxy), take the clients'
        # address and do the guard's job: no guard unit.
        host, port = address(args.listen)
        run = f" --workers {args.workers}" if args.workers else " --transparent"
        run += f" --listen-host {host} --port {port}"
        capabilities = "CAP_NET_ADMIN" if args.transparent else ""
        written = UNITS[:1]
        (units / UNITS[0]).write_text(proxy_unit(chosen, confdir, manager, run, capabilities))
        if (units / UNITS[1]).exists():
            if not args.no_start:
                systemctl(manager, "disable", "--now", UNITS[1])
            (units / UNITS[1]).unlink()
    else:
        written = UNITS
        run = f" --listen-host 127.0.0.1 --port {args.proxy_port}"
        if token is not None and chosen.keys is None and not chosen.config.option("control_token"):
            run += (" -- --set spillover_control_local=false --set "
                    f"spillover_control_token=@{token}")  # fmt: skip
        (units / UNITS[0]).write_text(proxy_unit(chosen, confdir, manager, run))
        (units / UNITS[1]).write_text(
            guard_unit(args.listen, args.proxy_port, args.primary, token, manager)
        )
    print(f"services: wrote {', '.join(str(units / u) for u in written)}")
    if manager.system and manager.run_as != "root":
        owned = give_to_user(manager.run_as, confdir, create=not args.no_start)
        if owned is not None:
            print(f"services: {owned}")
    if not args.no_start:
        start(manager, units, written)
    print(f"services: status, watch, doctor and stress read it too: --config {chosen.path}")
    print(clients(args))


def behind(args: argparse.Namespace) -> str:
    """What listens on the clients' address."""
    if args.workers:
        return f"HAProxy, in front of {args.workers} proxies"
    if args.transparent:
        return "the proxy (clients keep the primary's URL: the kernel sends them here)"
    return f"the guard, in front of the proxy on 127.0.0.1:{args.proxy_port}"


def check(
    args: argparse.Namespace,
    servers: list[str],
    routed: bool,
    service_user: User | None,
    settings_file: Path | None,
) -> None:
    """Refuse what cannot work, before anything is written (see scripts.parts.servicechecks)."""
    mine = servicechecks.listeners(args.listen, args.proxy_port, guarded=not routed)
    refused = servicechecks.contradictions(mine, servers)
    here = servicechecks.on_this_machine(mine, UNITS, service_user, command(), settings_file)
    if args.no_start:
        for problem in here:
            print(f"services: WARNING: {problem}")
    else:
        refused += here
    if refused:
        raise SystemExit("\n".join(f"services: {problem}" for problem in refused))


def start(manager: Manager, units: Path, written: tuple[str, ...]) -> None:
    why = (
        systemctl(manager, "daemon-reload")
        or systemctl(manager, "enable", *written)
        or systemctl(manager, "restart", *written)  # a new install's units replace the old
    )
    if why is not None:
        kind = "" if manager.system else " user"
        print(f"services: not started: {why}; this machine has no{kind} systemd to run them.")
        print(f"services: start them by hand:\n{by_hand(units)}")
    elif not manager.system:
        print(
            "services: user services stop at logout and start at login: "
            "`loginctl enable-linger` runs them from boot (or install --system)"
        )


def clients(args: argparse.Namespace) -> str:
    """Where clients go, said last."""
    if args.transparent:
        return f"services: clients keep the primary's URL, {args.primary}"
    host, port = address(args.listen)
    if host in EVERY_ADDRESS:
        host = "<this machine's address>"
    elif ":" in host:
        host = f"[{host}]"
    behind = (
        f"HAProxy in front of {args.workers} proxies"
        if args.workers
        else f"the guard; the proxy behind it listens on 127.0.0.1:{args.proxy_port}"
    )
    return f"services: clients use http://{host}:{port}/v1 ({behind})"


def uninstall(args: argparse.Namespace) -> None:
    confdir, units = places(args)
    manager = Manager(args.system)
    if not args.no_start:
        systemctl(manager, "disable", "--now", *UNITS)
    for unit in UNITS:
        (units / unit).unlink(missing_ok=True)
    if args.purge:
        shutil.rmtree(confdir, ignore_errors=True)
    if not args.no_start and (why := systemctl(manager, "daemon-reload")) is not None:
        print(f"services: {why}")
    print("services: removed" + (f" with {confdir}" if args.purge else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    put = commands.add_parser("install", help="write the units and the options, and start them")
    put.add_argument("--config", type=Path, metavar="FILE.yaml", help=HELP)
    put.add_argument("--primary", help="the primary's URL (default: the settings file's)")
    put.add_argument("--fallbacks", help="comma-separated fallback URLs")
    put.add_argument(
        "--listen",
        help="the clients' address: the guard's, which passes them to the proxy while it is "
        "up and to the primary while it is not; with --workers HAProxy's (default: the "
        "settings file's listen_host and port, 127.0.0.1:8090, as spillover run's)",
    )  # fmt: skip
    put.add_argument(
        "--proxy-port", type=int, default=8091,
        help="the proxy's own port on 127.0.0.1, behind the guard (default 8091)",
    )  # fmt: skip
    put.add_argument(
        "--workers", type=int,
        help="run this many proxies behind HAProxy on --listen, instead of one and the guard",
    )  # fmt: skip
    put.add_argument(
        "--transparent", action="store_true",
        help="clients keep the primary's URL: the kernel's rules send its connections to the "
        "proxy (no guard: the rules go with the proxy); with --system",
    )  # fmt: skip
    remove = commands.add_parser("uninstall", help="stop and remove the units")
    remove.add_argument(
        "--purge", action="store_true", help="remove their folder too (the settings it wrote)"
    )
    for command_parser in (put, remove):
        command_parser.add_argument(
            "--system", action="store_true",
            help="system units (/etc/systemd/system, options in /etc/spillover): from boot, "
            "as --run-as, after --after; default: the person's user units",
        )  # fmt: skip
        command_parser.add_argument(
            "--config-dir", type=Path, help="the services' folder (their settings, the token)"
        )
        command_parser.add_argument("--unit-dir", type=Path, help="where the units go")
        command_parser.add_argument(
            "--no-start", action="store_true", help="only write (or remove) the files"
        )
    put.add_argument(
        "--run-as", default="spillover", help="the system units' user (default spillover)"
    )
    put.add_argument(
        "--after", default="",
        help="comma-separated units to start after, such as the engines' (llama-server.service)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.command == "install":
        install(args)
    else:
        uninstall(args)


if __name__ == "__main__":
    main()
