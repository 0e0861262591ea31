"""Run the proxy for real: systemd user services for mitmdump with the addon and for the
fail-open guard, with the options in one file a person edits.

    spillover services install --primary http://127.0.0.1:8081 \\
        --fallbacks http://127.0.0.1:8082 [--listen 127.0.0.1:8080] [--proxy-port 8090]
    spillover services uninstall [--purge]

`install` writes `~/.config/spillover/config.yaml` (mitmproxy's own options file, in a
confdir of its own; kept if it exists), `spillover-proxy.service` (`spillover run
--confdir`, restarted on failure) and `spillover-guard.service` (`spillover guard` on the
clients' port), both running the installed command, in
`~/.config/systemd/user/`, then enables and starts both (`--no-start`: only writes).
A non-loopback `--listen` is public: the proxy then trusts no local client on its control
routes, and proxy and guard share a control token in `~/.config/spillover/control-token`
(made once, mode 0600), which the guard's health check carries.
`uninstall` stops and removes the services; `--purge` removes the options file and the
token too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

from scripts.guard import address, is_loopback

UNITS = ("spillover-proxy.service", "spillover-guard.service")
# An options file an earlier version wrote named the addon's file in a checkout; the
# proxy unit's `spillover run` loads the addon itself now.
OLD_SCRIPTS = re.compile(r"^scripts:\n  - \S*addon/spillover\.py\n", re.MULTILINE)


def command() -> Path:
    """The installed `spillover` command, beside this Python (pip install puts it there)."""
    found = Path(sys.executable).parent / "spillover"
    if not found.exists():
        raise SystemExit(
            f"services: no spillover command beside {sys.executable}: install the project "
            "(pip install . in the checkout, or scripts/setup.sh) first"
        )
    return found


def config_home() -> Path:
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")


def token_file() -> Path:
    return config_home() / "spillover" / "control-token"


def ensure_token() -> Path:
    """The control token the proxy and the guard share (made once, readable by its owner
    only): the guard's health check carries it where local clients are not trusted."""
    path = token_file()
    if not path.exists():
        path.touch(mode=0o600)
        path.write_text(secrets.token_urlsafe(32) + "\n")
    return path


def options_file(
    primary: str, fallbacks: str, proxy_port: int, public: bool, workers: int = 0
) -> str:
    # Behind a guard on a public address every client looks local: no control without
    # the token then (the guard has it too, for its health check). Behind HAProxy (the
    # workers) the control routes see each client's own address.
    token = json.dumps(f"@{token_file()}")
    guarded = public and not workers
    local = f"spillover_control_local: false\nspillover_control_token: {token}\n" if guarded else ""
    # The workers' command names the primary and the fallbacks (each worker its own port).
    route = "" if workers else (
        "mode:\n"
        f"  - reverse:{primary}@127.0.0.1:{proxy_port}\n"
        f"spillover_fallbacks: {json.dumps(fallbacks)}\n"  # (YAML reads an empty value as null)
    )  # fmt: skip
    return (
        "# The spillover proxy's options, in mitmproxy's own format: any mitmproxy option\n"
        "# or spillover_* option (docs/running.md lists them). Restart the service after an edit:\n"
        "#   systemctl --user restart spillover-proxy\n"
        f"{route}{local}"
        "flow_detail: 0\n"
    )


def proxy_unit(confdir: Path, workers: str = "") -> str:
    """`workers`: the `run` arguments of workers behind HAProxy, if any."""
    return (
        "[Unit]\n"
        "Description=spillover proxy: mitmdump with the spillover addon\n"
        "After=network.target\n\n"
        "[Service]\n"
        f"ExecStart={command()} run --confdir {confdir}{workers}\n"
        "Restart=on-failure\n"
        "RestartSec=1\n\n"
        "[Install]\n"
        "WantedBy=default.target\n"
    )


def guard_unit(listen: str, proxy_port: int, primary: str, public: bool) -> str:
    target = primary.split("//", 1)[-1].rstrip("/")
    extra = f" --public --token-file {token_file()}" if public else ""
    return (
        "[Unit]\n"
        "Description=spillover guard: clients reach the primary when the proxy is down\n"
        "After=network.target\n\n"
        "[Service]\n"
        f"ExecStart={command()} guard --listen {listen} "
        f"--proxy 127.0.0.1:{proxy_port} --primary {target}{extra}\n"
        "Restart=always\n"
        "RestartSec=1\n\n"
        "[Install]\n"
        "WantedBy=default.target\n"
    )


def systemctl(*args: str) -> str | None:
    """Run `systemctl --user`; why it could not, or None."""
    if shutil.which("systemctl") is None:
        return "no systemctl here"
    run = subprocess.run(["systemctl", "--user", *args], capture_output=True, text=True)
    if run.returncode != 0:
        said = (run.stderr or run.stdout).strip().splitlines()
        return f"systemctl --user {args[0]} failed ({said[0] if said else run.returncode})"
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


def install(args: argparse.Namespace) -> None:
    confdir = config_home() / "spillover"
    units = config_home() / "systemd" / "user"
    confdir.mkdir(parents=True, exist_ok=True)
    units.mkdir(parents=True, exist_ok=True)
    options = confdir / "config.yaml"
    public = not is_loopback(address(args.listen)[0])
    if public:
        ensure_token()
    if options.exists():
        print(f"services: keeping {options} as it is")
        kept = options.read_text()
        given = [args.primary, *filter(None, args.fallbacks.split(","))]
        if missing := [url for url in given if url not in kept]:
            print(
                f"services: WARNING: {options} does not name {', '.join(missing)}, given now: "
                "edit it, or uninstall --purge and install again"
            )
        if OLD_SCRIPTS.search(kept):
            options.write_text(OLD_SCRIPTS.sub("", kept))
            print(f"services: {options} named the addon's file: removed (the unit loads it)")
        if public and "spillover_control_token" not in options.read_text():
            print(
                f"services: the guard checks the proxy with the token in {token_file()}: "
                f"add spillover_control_token: '@{token_file()}' to {options}"
            )
    else:
        options.write_text(
            options_file(args.primary, args.fallbacks, args.proxy_port, public, args.workers)
        )
        print(f"services: wrote {options}")
    if args.workers:
        # HAProxy takes the clients' address and does the guard's job (scripts/workers).
        host, port = address(args.listen)
        workers = (
            f" --primary {args.primary} --fallbacks '{args.fallbacks}' --workers {args.workers}"
            f" --listen-host {host} --port {port}"
        )
        written = UNITS[:1]
        (units / UNITS[0]).write_text(proxy_unit(confdir, workers))
        if (units / UNITS[1]).exists():
            if not args.no_start:
                systemctl("disable", "--now", UNITS[1])
            (units / UNITS[1]).unlink()
    else:
        written = UNITS
        (units / UNITS[0]).write_text(proxy_unit(confdir))
        (units / UNITS[1]).write_text(
            guard_unit(args.listen, args.proxy_port, args.primary, public)
        )
    print(f"services: wrote {', '.join(str(units / u) for u in written)}")
    if not args.no_start:
        why = systemctl("daemon-reload") or systemctl("enable", "--now", *written)
        if why is not None:
            print(f"services: not started: {why}; this machine has no user systemd to run them.")
            print(f"services: start them by hand:\n{by_hand(units)}")
            return
        print(f"services: clients use {args.listen}; the proxy listens on {args.proxy_port}")


def uninstall(args: argparse.Namespace) -> None:
    units = config_home() / "systemd" / "user"
    if not args.no_start:
        subprocess.run(["systemctl", "--user", "disable", "--now", *UNITS], check=False)
    for unit in UNITS:
        (units / unit).unlink(missing_ok=True)
    if args.purge:
        shutil.rmtree(config_home() / "spillover", ignore_errors=True)
    if not args.no_start and (why := systemctl("daemon-reload")) is not None:
        print(f"services: {why}")
    print("services: removed" + (" with the options file" if args.purge else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    put = commands.add_parser("install")
    put.add_argument("--primary", required=True, help="the primary's URL")
    put.add_argument("--fallbacks", default="", help="comma-separated fallback URLs")
    put.add_argument("--listen", default="127.0.0.1:8080", help="the clients' address (guard)")
    put.add_argument("--proxy-port", type=int, default=8090)
    put.add_argument(
        "--workers", type=int, default=0,
        help="run this many proxies behind HAProxy on --listen, instead of one and the guard",
    )  # fmt: skip
    put.add_argument("--no-start", action="store_true", help="only write the files")
    remove = commands.add_parser("uninstall")
    remove.add_argument("--purge", action="store_true", help="remove the options file too")
    remove.add_argument("--no-start", action="store_true", help="do not call systemctl")
    args = parser.parse_args()
    if args.command == "install":
        install(args)
    else:
        uninstall(args)


if __name__ == "__main__":
    main()
