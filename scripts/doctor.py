"""What this machine offers the spillover addon, and how to fix what is missing.

    .venv/bin/python -m scripts.doctor --servers http://127.0.0.1:8081,http://127.0.0.1:8082

Memory sources and the cards they see, udev hotplug, which card each server sits on,
the pressure lines in force, and the llama-server the test bed would use.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import httpx

from watchers.gates import CardMap, parse_card_map
from watchers.hotplug import DrmEvents, UdevObserver
from watchers.pressure import Lines
from watchers.reading import CardFailure, NotApplicable
from watchers.sources import ALL, gpu_pids, open_sources

OK, MISSING = "ok  ", "--  "


def describe_server(url: str, cards: CardMap) -> str:
    try:
        props = httpx.get(f"{url}/props", timeout=2).json()
        settings = props.get("default_generation_settings", {})
        model = f"{Path(props.get('model_path', '?')).name}, {settings.get('n_ctx', '?')} ctx/slot"
    except (httpx.HTTPError, ValueError) as exc:
        return f"{MISSING}{url}: not answering /props ({exc.__class__.__name__}); is it running?"
    on = ", ".join(sorted(cards.cards_of(url))) or (
        "unknown: not on this machine, or not found; say it with spillover_cards"
    )
    return f"{OK}{url}: {model}; cards: {on}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", default="", help="comma-separated server URLs")
    parser.add_argument("--cards", default="", help="explicit mapping, as spillover_cards")
    parser.add_argument("--sysfs-root", type=Path, default=Path("/sys"))
    parser.add_argument("--proc-root", type=Path, default=Path("/proc"))
    args = parser.parse_args()

    print("memory sources")
    sources, missing = open_sources(ALL, args.sysfs_root, args.proc_root)
    for source in sources:
        results = source.read()
        print(f"  {OK}{source.name}: {len(results)} card(s)")
        for result in results:
            if isinstance(result, CardFailure):
                print(f"        {result.card}: cannot be read: {result.error}")
            else:
                total = f"{result.total_mib:,.0f}" if result.total_mib else "?"
                print(f"        {result.card}: {result.used_mib:,.0f} of {total} MiB used")
    for name, why in missing.items():
        print(f"  {MISSING}{name}: {why}")
    try:
        UdevObserver(DrmEvents(lambda: None, lambda card: None, lambda: None))
        print(f"  {OK}udev: hotplug events will be followed")
    except NotApplicable as exc:
        print(f"  {MISSING}udev: {exc}")

    lines = Lines()
    print(
        f"\npressure lines (defaults; --set spillover_... to change): "
        f"{lines.used_fraction:.0%} used, {lines.free_floor_mib:.0f} MiB free floor, "
        f"step {lines.step_mib:.0f} MiB within {lines.window_s * 1000:.0f} ms leaving "
        f"<= {lines.step_free_mib:.0f} MiB free; two samples in a row"
    )

    servers = [s.strip().rstrip("/") for s in args.servers.split(",") if s.strip()]
    if servers:
        print("\nservers")
        cards = CardMap(parse_card_map(args.cards), lambda: gpu_pids(sources), args.proc_root)
        for url in servers:
            print("  " + describe_server(url, cards))

    print("\nllama-server for the demo and tests")
    from scripts.llamabin import BinaryNotFound, find_binary

    try:
        print(f"  {OK}{find_binary()}")
    except BinaryNotFound as exc:
        print(f"  {MISSING}{exc}")


if __name__ == "__main__":
    main()
