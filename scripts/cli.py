"""The `spillover` command: the proxy and its tools under one name.

    spillover run --primary http://127.0.0.1:8081 --fallbacks http://127.0.0.1:8082
    spillover run --config spillover.yaml           (the same, and any option, in a file)
    spillover run -v ...                            (mitmproxy's log of every connection too)
    spillover run --confdir ~/.config/spillover     (options in its config.yaml)
    spillover run --primary URL --workers 4         (4 proxies behind HAProxy)
    spillover run --primary URL --transparent       (clients keep the primary's URL)
    spillover run --primary URL --transparent --workers 4
    spillover status [--config FILE | --proxy URL] [--json]
    spillover options                               (the addon's spillover_* options)
    mitmweb -s "$(spillover addon-path)" --mode reverse:URL@127.0.0.1:8090 \\
        --set web_port=8070                            (the addon by hand, with mitmweb's page)
    spillover doctor | watch | stress | services | guard ...   (each with --help)

`run` starts mitmdump with the addon in front of the primary, so a person need not know
where the addon's file is; what follows `--` goes to mitmdump as it is (`--set
spillover_cards=...`, `-w flows.mitm`). Every command reads its settings from one file,
`--config FILE.yaml` or ./spillover.yaml (scripts/parts/config.py); `spillover options`
lists the addon's options.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import shutil
import sys
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

import httpx
from mitmproxy.exceptions import OptionsError

from addon.servers.credentials import read_secret
from addon.servers.urlchecks import url_mistake
from scripts.parts.config import DEFAULTS, HELP, load, named_mistakes, settle
from scripts.parts.config import mistakes as run_mistakes
from scripts.parts.options import main as list_options
from scripts.parts.summary import summary

ADDON = Path(__file__).resolve().parent.parent / "addon" / "spillover.py"
TOOLS = {
    "doctor": ("scripts.doctor", "what this machine offers the addon, and what is missing"),
    "watch": ("scripts.watch", "a live view of the proxy's cards, servers and answers"),
    "stress": ("scripts.stress", "make real memory pressure, to watch a handoff happen"),
    "services": ("scripts.services", "run the proxy and its guard as systemd user services"),
    "guard": ("scripts.guard", "pass clients to the primary while the proxy is down"),
}


def mitmdump_argv(args: argparse.Namespace, extra: list[str]) -> list[str]:
    mitmdump = shutil.which("mitmdump", path=str(Path(sys.executable).parent)) or "mitmdump"
    argv = [mitmdump, "-s", str(ADDON)]
    if args.confdir is not None:  # its config.yaml names the primary and the rest
        argv += ["--set", f"confdir={args.confdir}"]
    if args.primary is not None:
        primary = args.primary.rstrip("/")
        # The port answers whatever is done besides (the control routes, clients that
        # name it): a transparent listener cannot, as a connection straight to it has no
        # other destination.
        argv += ["--mode", f"reverse:{primary}@{args.listen_host}:{args.port}"]
        if args.transparent:  # the kernel's rules send the primary's connections here,
            # to a port of the system's choosing on every address (they arrive at the
            # address of the interface they came in by)
            argv += ["--mode", "transparent@0", "--set", "spillover_redirect=true"]
        elif args.capture:  # mitmproxy takes these programs' connections itself
            argv += ["--mode", f"local:{args.capture}"]
        if args.transparent or args.capture:
            argv += ["--set", f"spillover_primary={primary}"]
        argv += ["--set", f"spillover_fallbacks={args.fallbacks}"]
    return argv + extra


def status(args: argparse.Namespace) -> int:
    config = load(args.config, "spillover status")
    proxy = args.proxy or config.proxy_url()
    if mistake := url_mistake(proxy, "proxy"):
        print(f"spillover status: {mistake}", file=sys.stderr)
        return 2
    try:
        token = args.token or read_secret(config.option("control_token") or "")
    except OptionsError as exc:  # a token file this user may not read
        print(f"spillover status: {config.path}: control_token: {exc}", file=sys.stderr)
        return 2
    headers = {"authorization": f"Bearer {token}"} if token else {}
    try:
        reply = httpx.get(f"{proxy.rstrip('/')}/spillover/status", headers=headers, timeout=5)
    except httpx.HTTPError as exc:
        print(f"spillover status: no proxy at {proxy} ({exc.__class__.__name__})", file=sys.stderr)
        return 1
    if reply.status_code != 200 or "servers" not in reply.text:
        print(f"spillover status: {proxy} is not a spillover proxy (or wants the control token)")
        return 1
    print(json.dumps(reply.json(), indent=2) if args.json else "\n".join(summary(reply.json())))
    return 0


def version() -> str:
    """The installed distribution's version; from a checkout that is not installed, the
    one its pyproject.toml gives."""
    try:
        return importlib.metadata.version("spillover")
    except importlib.metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        return tomllib.loads(pyproject.read_text())["project"]["version"]


def refuse(mistakes: Sequence[str]) -> NoReturn:
    """Say each mistake in one line, and start nothing."""
    for mistake in mistakes:
        print(f"spillover run: {mistake}", file=sys.stderr)
    sys.exit(2)


RUN_EPILOG = """\
What follows `--` goes to mitmdump as it is: mitmproxy's options and the addon's
(`-- --set spillover_free_floor_mib=256 -w flows.mitm`); `spillover options` lists the
addon's. The settings file (--config, or ./spillover.yaml) holds the flags' settings
(primary, fallbacks: a list, port, listen_host, workers), any spillover_* option by its
name, with or without the prefix, and mitmdump's own options; the flags given win over
it. The log holds handoffs, warnings and errors; -v adds mitmproxy's line for every
connection and flow.
"""


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="spillover", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"spillover {version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = commands.add_parser(
        "run", help="mitmdump with the addon in front of the primary", allow_abbrev=False,
        epilog=RUN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    run.add_argument("--config", type=Path, metavar="FILE.yaml", help=HELP)
    run.add_argument(
        "-v", "--verbose", action="store_true",
        help="log every connection and flow, as mitmdump does (default: handoffs, warnings, "
        "errors)",
    )  # fmt: skip
    run.add_argument("--primary", help="the primary server's URL (http://HOST:PORT)")
    run.add_argument("--fallbacks", help="comma-separated fallback URLs, in order (default: none)")
    run.add_argument(
        "--listen-host", help=f"where clients connect (default: {DEFAULTS['listen_host']})"
    )
    run.add_argument(
        "--port", type=int, help=f"the port clients connect to (default: {DEFAULTS['port']})"
    )
    taken = run.add_mutually_exclusive_group()
    taken.add_argument(
        "--transparent", action="store_true",
        help="clients keep the primary's URL: the kernel sends its connections to the proxy "
        "(mitmproxy's transparent mode, nftables rules that live as long as the proxy)",
    )  # fmt: skip
    taken.add_argument(
        "--capture", metavar="PROGRAMS",
        help="clients keep the primary's URL: mitmproxy's local capture mode takes the "
        "connections of these programs (comma-separated names or pids)",
    )  # fmt: skip
    run.add_argument(
        "--workers", type=int, nargs="?", const=os.cpu_count() or 1, metavar="N",
        help="run N proxies behind HAProxy (N left out: one per core); default: one proxy "
        "and no HAProxy",
    )  # fmt: skip
    run.add_argument(
        "--confdir", type=Path,
        help="a mitmproxy confdir whose config.yaml holds the options (the services' way; "
        "then --primary is not needed where it names the primary)",
    )  # fmt: skip
    state = commands.add_parser("status", help="what the proxy knows now (GET /spillover/status)")
    state.add_argument("--config", type=Path, metavar="FILE.yaml", help=HELP)
    state.add_argument(
        "--proxy", help="the proxy's URL (default: the settings file's listen_host and port; "
        "http://127.0.0.1:8090)",
    )  # fmt: skip
    state.add_argument(
        "--token", help="the control token, for a proxy on another machine (default: the "
        "settings file's control_token)",
    )  # fmt: skip
    state.add_argument("--json", action="store_true", help="the proxy's whole answer, as JSON")
    commands.add_parser("options", help="the addon's spillover_* options: type, default, meaning")
    commands.add_parser("addon-path", help="print the addon's file, for mitmdump -s or mitmweb -s")
    for name, (_, said) in TOOLS.items():
        commands.add_parser(name, help=said, add_help=False)
    if argv and argv[0] in TOOLS:
        module = importlib.import_module(TOOLS[argv[0]][0])
        sys.argv = [f"spillover {argv[0]}", *argv[1:]]
        module.main()
        return
    args, extra = parser.parse_known_args(argv)
    if args.command == "status":
        sys.exit(piped(lambda: status(args)))
    if args.command == "options":
        sys.exit(piped(list_options))
    if args.command == "addon-path":
        print(ADDON)
        return
    if extra and extra[0] != "--":
        parser.error(f"unknown arguments {' '.join(extra)} (mitmdump's go after --)")
    extra = [arg for arg in extra if arg != "--"]
    extra = settle(args, extra) + extra
    if mistakes := run_mistakes(args) or named_mistakes(args, extra):
        refuse(mistakes)
    if (args.transparent or args.capture) and args.primary is None:
        refuse(["--transparent and --capture need --primary"])
    if args.capture and args.workers:
        refuse(["--capture runs one proxy (not --workers)"])
    if args.workers:
        sys.exit(run_workers(args, extra))
    command = mitmdump_argv(args, extra)
    os.execv(command[0], command)


def piped(command: Callable[[], int | None]) -> int:
    """Its exit status; a reader that stops early (`spillover status | head`) ends it quietly,
    as it ends `cat`."""
    try:
        code = command() or 0
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 0


def run_workers(args: argparse.Namespace, extra: list[str]) -> int:
    from scripts.workers.pool import HaproxyMissing, RedirectFailed, Workers

    if args.primary is None:
        print("spillover run: --workers needs --primary", file=sys.stderr)
        return 2
    mitmdump = shutil.which("mitmdump", path=str(Path(sys.executable).parent)) or "mitmdump"
    command = [mitmdump, "-s", str(ADDON)]
    if args.confdir is not None:  # its config.yaml holds the other options
        command += ["--set", f"confdir={args.confdir}"]
    pool = Workers(
        args.primary, args.fallbacks, args.workers, (args.listen_host, args.port),
        command, extra, transparent=args.transparent,
    )  # fmt: skip
    try:
        pool.start()
    except (HaproxyMissing, RedirectFailed) as exc:
        print(f"spillover run: {exc}", file=sys.stderr)
        return 2
    return pool.supervise()


if __name__ == "__main__":
    main()
