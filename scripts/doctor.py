"""What this machine offers the spillover addon, and how to fix what is missing.

    .venv/bin/python -m scripts.doctor --servers http://127.0.0.1:8081,http://127.0.0.1:8082 \
        [--slot-dir DIR] [--prometheus http://prometheus:9090]

Memory sources and the cards they see with the pressure lines in force on each, which
hotplug events this machine will signal, which card each server sits on, with
`--slot-dir` (as spillover_slot_dir) which servers an answer can move between with its
KV state and why not, with `--prometheus` the cards of other hosts and whether their
readings are fresh, whether clients can be taken without changing them (`spillover run
--transparent`, `--capture`) and why not, and the llama-server the test bed would use.
With `--config FILE` (or a ./spillover.yaml) the servers, cards and options the flags
leave out are the settings file's, as the proxy reads them.

It exits with 1 when what it found stops the protection (EXIT_RULE), else with 0.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import itertools
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from addon.servers import keyed
from addon.servers.credentials import read_secret
from addon.servers.directory import ServerDirectory
from addon.servers.fingerprint import Fingerprint, fingerprint_for_migration
from addon.servers.info import ServerInfo
from addon.servers.upstream import Upstream
from addon.servers.urlchecks import server_mistakes
from addon.surface.nftables import owner_tables_work
from scripts.parts import cardorder
from scripts.parts.config import Config, with_config
from watchers.cardids import unknown_cards
from watchers.gates import CardMap
from watchers.hotplug import HotplugEvents, UdevObserver, pci_cards, what_is_seen
from watchers.nvml import NvmlSource
from watchers.pressure import Lines
from watchers.prometheus import Matcher, PrometheusSource
from watchers.reading import CardFailure, NotApplicable, Reading
from watchers.sources import ALL, card_map, open_sources

OK, MISSING = "ok  ", "--  "
EXIT_RULE = (
    "exits with 1 when something it found stops the protection: no memory source can be "
    "read (no pressure handoff), a server given does not answer as a server (not "
    "running, still loading, a proxy), or --cards names a card no source reports; else "
    "with 0, warnings and the optional parts (--transparent, --capture, KV migration, "
    "llama-server) aside; with 2 at once, in one line, for a mistake in what it was given "
    "(a server's URL, a --cards entry that names none of --servers)"
)
CAP_NET_ADMIN = 12
CGROUP_ROOT = "/sys/fs/cgroup"
GRANT_PERFMON = (
    "card-wide use needs CAP_PERFMON for the proxy: AmbientCapabilities=CAP_PERFMON in "
    "its systemd unit, --cap-add PERFMON for a container, or setcap cap_perfmon+ep on its "
    "Python; until then memory of processes it cannot see is not counted"
)


async def ask_servers(urls: list[str]) -> dict[str, ServerInfo | str]:
    """What the addon learns of each server, asked as it asks a fallback
    (addon/servers/directory.py, proof.py); a spillover proxy given by mistake is named."""
    directory = ServerDirectory()
    found: dict[str, ServerInfo | str] = {}
    try:
        for url in urls:
            try:
                status = httpx.get(f"{url}/spillover/status", timeout=2)
                if status.status_code == 200 and "servers" in status.json():
                    found[url] = "a spillover proxy, not a server: give the servers behind it"
                    continue
            except (httpx.HTTPError, ValueError):
                pass
            found[url] = await directory.probe(Upstream(url), generate=True)
    finally:
        await directory.close()
    return found


def remote_lines(remote: PrometheusSource, lines: Lines) -> list[str]:
    """Asks once: what each remote card reads, and whether it is fresh enough to trust."""
    remote.poll()
    if remote.error is not None:
        return [f"{MISSING}{remote.shown}: {remote.error}: remote cards are unknown"]
    if not remote.cards:
        return [f"{MISSING}{remote.shown} answers, but holds no memory series of a known exporter"]
    found = []
    now = time.monotonic()
    for reading in remote.read():
        assert isinstance(reading, Reading)
        card = remote.cards[reading.card]
        age, fresh = now - reading.time, reading.fresh_for(0.0)
        mark = OK if age <= fresh else MISSING
        state = "fresh" if age <= fresh else "STALE: unknown, not trusted"
        found.append(
            f"{mark}{describe_card(reading, lines)} [{card.exporter}, hosts "
            f"{', '.join(sorted(card.hosts))}; scraped {age:.1f} s ago, fresh for "
            f"{fresh:.1f} s: {state}]"
        )
    return found


def describe_server(url: str, info: ServerInfo | str, cards: CardMap) -> str:
    if isinstance(info, str):
        return f"{MISSING}{url}: {info}"
    if info.engine == "openai-compatible" and not info.models:
        held = cards.mapping_of(url)
        if held.pids:  # a server answers 503 to everything while it loads its model
            return (
                f"{MISSING}{url}: answers neither /props nor /v1/models, though its port is "
                f"held: still loading its model? Ask again once it has loaded ({held})"
            )
        return f"{MISSING}{url}: answers neither /props nor /v1/models; is it running?"
    context = f"{info.slot_context} ctx/slot" if info.slot_context else "context per slot unknown"
    model = Path(info.model or "?").name
    mapping = cards.mapping_of(url)
    on = ", ".join(sorted(mapping.cards)) or "none known"
    return f"{OK}{url}: {info.engine}, {model}, {context}; cards: {on} (by {mapping})"


def slot_warnings(infos: dict[str, ServerInfo | str]) -> list[str]:
    """A fallback whose slots hold less than the primary's (the first server) takes only
    answers cut early: the rest of a long one does not fit."""
    known = {u: i.slot_context for u, i in infos.items() if isinstance(i, ServerInfo)}
    primary, *fallbacks = list(infos)
    mine = known.get(primary)
    warnings = []
    for url in fallbacks:
        theirs = known.get(url)
        if mine and theirs and theirs < mine:
            warnings.append(
                f"WARNING: {url} has {theirs} tokens per slot, fewer than the primary's {mine}: "
                "an answer cut late does not fit there (a slot is llama-server's --ctx-size "
                "divided by --parallel; a continuation needs the prompt, the answer so far "
                "and what is left of max_tokens)"
            )
    return warnings


def continuation_of(url: str, info: ServerInfo | str) -> str:
    """Which engine the server is and whether (and how) it continues an answer."""
    if isinstance(info, str):
        return f"{MISSING}{url}: {info}"
    said = (
        f"continues an answer, asked by {info.continues_by}"
        if info.continues
        else "continues no answer that sent text"
    )
    routes = f"; vLLM's own routes: {info.own_routes}" if info.own_routes else ""
    mark = OK if info.continues else MISSING
    return f"{mark}{url}: {info.engine}; {said}: {info.continues_why}{routes}"


async def fingerprint_of(url: str, slot_dir: Path) -> Fingerprint | str:
    async with httpx.AsyncClient(timeout=30) as client:

        async def ask(path: str, body: Any) -> Any:
            if body is None:
                response = await client.get(f"{url}{path}")
            else:
                response = await client.post(f"{url}{path}", json=body)
            return response.raise_for_status().json()

        return await fingerprint_for_migration(ask, slot_dir)


def migration_lines(servers: list[str], slot_dir: Path) -> list[str]:
    """Each server's fingerprint, and whether each pair can move answers' KV state."""
    prints = {url: asyncio.run(fingerprint_of(url, slot_dir)) for url in servers}
    lines = []
    for url, print_ in prints.items():
        if isinstance(print_, Fingerprint):
            lines.append(f"{OK}{url}: model {print_.model[:23]}, logits {print_.logits}")
        else:
            lines.append(f"{MISSING}{url}: {print_}")
    for a, b in itertools.combinations(servers, 2):
        pa, pb = prints[a], prints[b]
        if isinstance(pa, Fingerprint) and isinstance(pb, Fingerprint):
            differ = pa.differences(pb)
            said = f"differ in {', '.join(differ)}: replay" if differ else "same: KV state moves"
        else:
            said = "not both fingerprinted: replay"
        lines.append(f"  {a} <-> {b}: {said}")
    return lines


def describe_card(reading: Reading, lines: Lines) -> str:
    """Use, and the lines in force on this card, taking what it has free now as its rest
    (as the proxy does at start)."""
    if reading.total_mib is None:
        return f"{reading.card}: {reading.used_mib:,.0f} MiB used (total unknown: steps only)"
    free = reading.total_mib - reading.used_mib
    return (
        f"{reading.card}: {reading.used_mib:,.0f} of {reading.total_mib:,.0f} MiB used, "
        f"{free:,.0f} free; hands off on {lines.acts_on(reading.total_mib, free)}"
        f"{held_by(reading)}"
    )


def held_by(reading: Reading, proc: Path = Path("/proc")) -> str:
    """Who holds the card's memory, where its source says (NVML's process list, DRM fdinfo)."""
    if not reading.held:
        return ""

    def name(pid: int) -> str:
        try:
            return (proc / str(pid) / "comm").read_text().strip()
        except OSError:
            return "?"

    biggest = sorted(reading.held, key=lambda held: -held[1])
    return "; held by " + ", ".join(f"{name(pid)} {pid} {mib:,.0f} MiB" for pid, mib in biggest)


# Whether clients can be taken without changing them. `--transparent`: nftables rules in
# an owner table (addon/surface/nftables.py). `--capture`: mitmproxy's local capture mode,
# whose Linux redirector is started through sudo (even by root) and attaches eBPF
# programs to the cgroup v2 hierarchy at /sys/fs/cgroup.


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


def named_cards(
    args: argparse.Namespace, servers: list[str]
) -> tuple[dict[str, set[str]], dict[str, list[Matcher]]]:
    """--cards and --remote-cards by the server of `servers` each entry names, as the
    proxy keeps them; a mistake in these or in the servers' URLs ends the doctor here, in
    the line the proxy would say."""
    try:
        if mistakes := server_mistakes(servers[:1], servers[1:], []):
            raise ValueError(mistakes[0])
        return (
            keyed.by_server(keyed.CARDS, args.cards, servers),
            keyed.by_server(keyed.REMOTE_CARDS, args.remote_cards, servers),
        )
    except ValueError as exc:
        print(f"doctor: {exc}", file=sys.stderr)
        sys.exit(2)


def from_config(config: Config) -> dict[str, str | None]:
    """The flags' values a settings file gives: its servers, and the options named alike."""
    named = ("cards", "free_floor_mib", "slot_dir", "prometheus", "prometheus_token",
             "remote_cards", "sysfs_root", "proc_root")  # fmt: skip
    return {"servers": ",".join(config.servers()) or None} | {
        flag: config.option(flag) for flag in named
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=f"It {EXIT_RULE}.")
    parser.add_argument("--servers", default="", help="comma-separated server URLs")
    parser.add_argument("--cards", default="", help="explicit mapping, as spillover_cards")
    parser.add_argument("--sysfs-root", type=Path, default=Path("/sys"))
    parser.add_argument("--proc-root", type=Path, default=Path("/proc"))
    parser.add_argument("--free-floor-mib", type=int, default=0, help="as spillover_free_floor_mib")
    parser.add_argument("--slot-dir", type=Path, help="as spillover_slot_dir (KV migration)")
    parser.add_argument("--prometheus", default="", help="as spillover_prometheus")
    parser.add_argument("--prometheus-token", default="", help="as spillover_prometheus_token")
    parser.add_argument("--remote-cards", default="", help="as spillover_remote_cards")
    args, _ = with_config(parser, "doctor", from_config)

    servers = [s.strip().rstrip("/") for s in args.servers.split(",") if s.strip()]
    explicit, selectors = named_cards(args, servers)
    lines = Lines(free_floor_mib=args.free_floor_mib)
    print("memory sources (lines: --set spillover_free_floor_mib, _step_mib, _rearm_mib)")
    sources, missing = open_sources(ALL, args.sysfs_root, args.proc_root)
    seen: set[str] = set()
    for source in sources:
        results = source.read()
        seen |= {result.card for result in results}
        print(f"  {OK}{source.name}: {len(results)} card(s)")
        for result in results:
            if isinstance(result, CardFailure):
                print(f"        {result.card}: cannot be read: {result.error}")
            else:
                print(f"        {describe_card(result, lines)}")
                if how := getattr(source, "measured", {}).get(result.card):
                    print(f"          used: {how}")
                    if "no CAP_PERFMON" in how:
                        print(f"          {GRANT_PERFMON}")
    for name, why in missing.items():
        print(f"  {MISSING}{name}: {why}")
    stops = [] if sources else ["no memory source can be read"]
    if nvml := next((source for source in sources if isinstance(source, NvmlSource)), None):
        print("\nNVIDIA card ids (spillover_cards takes nvml:N; CUDA's own numbers may differ)")
        for line in cardorder.lines(nvml.handles):
            print(f"  {line}")
    if args.prometheus:
        token = read_secret(args.prometheus_token) or None
        remote = PrometheusSource(args.prometheus, token, interval_s=0)  # asked once, now
        print(f"\nremote cards (from {args.prometheus})")
        for line in remote_lines(remote, lines):
            print(f"  {line}")
        sources.append(remote)

    print("\nhotplug")
    try:
        observer: UdevObserver | str = UdevObserver(HotplugEvents(lambda: None, lambda: None))
    except NotApplicable as exc:
        observer = str(exc)
    for line in what_is_seen(pci_cards(args.sysfs_root), observer):
        print(f"  {line}")

    print("\nservers")
    if not servers:
        print(f"  {MISSING}none given: pass --servers PRIMARY,FALLBACK,... (the primary first)")
    else:
        for wrong in unknown_cards(explicit, seen):  # the proxy would refuse to start
            print(f"  {MISSING}{wrong}")
            stops.append("spillover_cards names a card that is not here")
        cards = card_map(explicit, sources, args.proc_root, args.sysfs_root, selectors)
        infos = asyncio.run(ask_servers(servers))
        for url in servers:
            said = describe_server(url, infos[url], cards)
            print(f"  {said}")
            stops += [f"{url} (see servers)"] if said.startswith(MISSING) else []
        for warning in slot_warnings(infos):
            print(f"  {warning}")
        print("\nwhich servers may continue an answer, and how (see docs/engines.md)")
        for url in servers:
            print("  " + continuation_of(url, infos[url]))
        if args.slot_dir is not None:
            print(f"\nKV migration (slots saved in {args.slot_dir})")
            for line in migration_lines(servers, args.slot_dir):
                print("  " + line)

    print("\nclients that change nothing (spillover run --transparent, --capture PROGRAMS)")
    for flag, why in (
        ("--transparent", transparent_why_not()),
        ("--capture", local_capture_why_not()),
    ):
        print(f"  {MISSING}{flag}: {why}" if why else f"  {OK}{flag}: this machine can")

    print("\nllama-server on this machine")
    named = os.environ.get("LLAMA_SERVER")
    found = named if named and os.access(named, os.X_OK) else shutil.which("llama-server")
    if found:
        print(f"  {OK}{found}")
    else:
        print(
            f"  {MISSING}none on PATH (nor LLAMA_SERVER): run your servers as you do; a "
            "checkout's scripts/setup.sh builds one for the demo and the tests"
        )
    if stops:
        print(f"\nwhat stops the protection: {'; '.join(stops)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
