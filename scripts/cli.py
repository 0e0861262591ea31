"""The `spillover` command: the proxy and its tools under one name.

    spillover run --primary http://127.0.0.1:8081 --fallbacks http://127.0.0.1:8082
    spillover run --confdir ~/.config/spillover     (options in its config.yaml)
    spillover run --primary URL --workers 4         (4 proxies behind HAProxy)
    spillover run --primary URL --transparent       (clients keep the primary's URL)
    spillover run --primary URL --transparent --workers 4
    spillover status [--proxy URL]
    mitmweb -s "$(spillover addon-path)" --mode reverse:URL@8090   (the addon, by hand)
    spillover doctor | watch | stress | services | guard ...   (each with --help)

`run` starts mitmdump with the addon in front of the primary, so a person need not know
where the addon's file is; what follows `--` goes to mitmdump as it is (`--set
spillover_cards=...`, `-w flows.mitm`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import sys
from pathlib import Path

import httpx

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
    return argv + [arg for arg in extra if arg != "--"]


def status(proxy: str, token: str | None) -> int:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    try:
        reply = httpx.get(f"{proxy.rstrip('/')}/spillover/status", headers=headers, timeout=5)
    except httpx.HTTPError as exc:
        print(f"spillover status: no proxy at {proxy} ({exc.__class__.__name__})", file=sys.stderr)
        return 1
    if reply.status_code != 200 or "servers" not in reply.text:
        print(f"spillover status: {proxy} is not a spillover proxy (or wants the control token)")
        return 1
    print(json.dumps(reply.json(), indent=2))
    return 0


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="spillover", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = commands.add_parser(
        "run", help="mitmdump with the addon in front of the primary", allow_abbrev=False
    )
    run.add_argument("--primary", help="the primary server's URL")
    run.add_argument("--fallbacks", default="", help="comma-separated fallback URLs, in order")
    run.add_argument("--listen-host", default="127.0.0.1", help="where clients connect")
    run.add_argument("--port", type=int, default=8090, help="the port clients connect to")
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
        "--workers", type=int, nargs="?", default=0, const=os.cpu_count() or 1, metavar="N",
        help="run N proxies behind HAProxy (N left out: one per core); without it, one "
        "proxy and no HAProxy",
    )  # fmt: skip
    run.add_argument(
        "--confdir", type=Path,
        help="a mitmproxy confdir whose config.yaml holds the options (the services' way; "
        "then --primary is not needed)",
    )  # fmt: skip
    state = commands.add_parser("status", help="what the proxy knows now (GET /spillover/status)")
    state.add_argument("--proxy", default="http://127.0.0.1:8090", help="the proxy's URL")
    state.add_argument("--token", help="the control token, for a proxy on another machine")
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
        sys.exit(status(args.proxy, args.token))
    if args.command == "addon-path":
        print(ADDON)
        return
    if extra and extra[0] != "--":
        parser.error(f"unknown arguments {' '.join(extra)} (mitmdump's go after --)")
    if args.primary is None and args.confdir is None:
        parser.error("run needs --primary (or --confdir with a config.yaml that names it)")
    if (args.transparent or args.capture) and args.primary is None:
        parser.error("--transparent and --capture need --primary")
    if args.capture and args.workers:
        parser.error("--capture runs one proxy (not --workers)")
    if args.workers:
        sys.exit(run_workers(args, extra))
    command = mitmdump_argv(args, extra)
    os.execv(command[0], command)


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
        command, [arg for arg in extra if arg != "--"], transparent=args.transparent,
    )  # fmt: skip
    try:
        pool.start()
    except (HaproxyMissing, RedirectFailed) as exc:
        print(f"spillover run: {exc}", file=sys.stderr)
        return 2
    return pool.supervise()


if __name__ == "__main__":
    main()
