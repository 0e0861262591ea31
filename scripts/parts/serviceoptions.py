"""The settings file the services run with: the person's own (`install --config FILE`, or
a ./spillover.yaml), else the one `install` keeps in its folder as a person left it, or
writes there from the flags. An earlier version's options (mitmproxy's own format, in
the folder's config.yaml, which mitmdump would read besides) become that file's keys."""

from __future__ import annotations

import argparse
import json
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mitmproxy.optmanager import parse

from scripts.parts.config import FILE, Config, ConfigError, found, from_data, load
from scripts.parts.options import declared
from scripts.parts.ports import address

OLD_OPTIONS = "config.yaml"
REVERSE = re.compile(r"^reverse:(.+)@[^@]*$")  # the reverse mode an earlier version wrote


def ensure_token(path: Path) -> Path:
    """The control token the proxy and the guard share (made once, readable by its owner
    only): the guard's health check carries it where local clients are not trusted."""
    if not path.exists():
        path.touch(mode=0o600)
        path.write_text(secrets.token_urlsafe(32) + "\n")
    return path


@dataclass
class Settings:
    """The file the units run with, what it says, and the flags given that win over it."""

    path: Path
    config: Config
    keys: dict[str, Any] | None = None  # what install is to write, where it writes the file
    old: Path | None = None  # an earlier version's options, moved aside
    flags: dict[str, str] = field(default_factory=dict)  # --primary, --fallbacks given

    def primary(self) -> str | None:
        return self.flags.get("primary") or self.config.get("primary")

    def fallbacks(self) -> str:
        return self.flags.get("fallbacks", self.config.get("fallbacks"))


def settings(args: argparse.Namespace, confdir: Path) -> Settings:
    """The file the units are to run with, read (its mistakes end install here)."""
    flags = {k: v for k in ("primary", "fallbacks") if (v := getattr(args, k)) is not None}
    old = confdir / OLD_OPTIONS
    old = old if old.exists() else None
    named = found(args.config)
    if named is not None:
        return Settings(named.absolute(), load(args.config, "services"), old=old, flags=flags)
    path = confdir / FILE.name
    if path.exists():
        print(f"services: keeping {path} as it is")
        return Settings(path, load(path, "services"), old=old, flags=flags)
    keys = (converted(old) if old else {}) | flags
    try:
        config = from_data(path, keys, declared())
    except ConfigError as exc:
        raise SystemExit("\n".join(f"services: {old}: {line}" for line in exc.lines)) from None
    return Settings(path, config, keys, old)


def settle(args: argparse.Namespace, chosen: Settings) -> None:
    """The servers, the clients' address and the workers: the flags given, else the file's."""
    args.primary = chosen.primary()
    if args.primary is None:
        raise SystemExit("services: install needs --primary (or a --config file that names it)")
    args.fallbacks = chosen.fallbacks()
    host, port = chosen.config.get("listen_host"), chosen.config.get("port")
    named = f"{f'[{host}]' if ':' in host else host}:{port}"
    if args.listen and chosen.keys is None and address(args.listen) != address(named):
        print(
            f"services: WARNING: {chosen.path} has clients at {named}, --listen {args.listen} "
            "given now: the units listen there, and status --config asks the file's"
        )
    args.listen = args.listen or named
    args.workers = chosen.config.get("workers") if args.workers is None else args.workers


def token_file(chosen: Settings, confdir: Path) -> Path:
    """The control token's file the proxy and the public guard share: the settings
    file's, else one made in the services' folder."""
    named = chosen.config.option("control_token")
    if named is None:
        return ensure_token(confdir / "control-token")
    if not named.startswith("@"):
        raise SystemExit(
            f"services: {chosen.path}: control_token is the token itself; the guard reads it "
            "from a file: name one (control_token: '@/path/to/file')"
        )
    return Path(named[1:])


def advise(chosen: Settings, token: Path | None, cards: str) -> None:
    """What a settings file install does not write lacks: the lines to add."""
    if token is not None and chosen.config.option("control_token") is None:
        print(
            f"services: the proxy's unit carries the control token in {token}; add "
            f"control_local: false and control_token: '@{token}' to {chosen.path} so that "
            "status and watch carry it too"
        )
    if cards and chosen.config.option("cards") is not None:
        print(f"services: {chosen.path} names its own spillover_cards: kept ({cards} found here)")
    elif cards:
        print(f'services: add this line to {chosen.path}: spillover_cards: "{cards}"')


def converted(old: Path) -> dict[str, Any]:
    """An earlier version's options file as the settings file's keys: its reverse mode's
    target is the primary; its addon file (the unit loads the addon) and its addresses
    (the units give them) are left out."""
    keys: dict[str, Any] = {}
    for key, value in (parse(old.read_text(encoding="utf-8")) or {}).items():
        if key == "mode":
            modes = [value] if isinstance(value, str) else value
            for mode in modes:
                if target := REVERSE.match(str(mode)):
                    keys["primary"] = target[1]
        elif key not in ("scripts", "listen_host", "listen_port"):
            keys["fallbacks" if key == "spillover_fallbacks" else key] = value
    return keys


def write(settings: Settings, address: tuple[str, int], behind: str, token: Path | None,
          cards: str) -> None:  # fmt: skip
    """Write the file install makes: its keys, the clients' `address` (`behind`: what
    listens there), the control token's options where the guard is public, and the
    servers' cards (a spillover_cards value) where the service user cannot find them;
    what the keys already name (an earlier install's) is kept."""
    assert settings.keys is not None
    keys = dict(settings.keys)
    fallbacks = keys.pop("fallbacks", "")
    fallbacks = fallbacks if isinstance(fallbacks, list) else fallbacks.split(",")
    keys = {"primary": keys.pop("primary"), "fallbacks": [url for url in fallbacks if url]} | keys
    if token is not None and settings.config.option("control_token") is None:
        keys |= {"control_local": False, "control_token": f"@{token}"}
    if cards and settings.config.option("cards") is None:
        keys["spillover_cards"] = cards
    else:
        advise(settings, None, cards)
        cards = ""
    settings.path.write_text(
        "# spillover's settings (docs/services.md): the proxy's unit runs `spillover run\n"
        "# --config` on this file, and `spillover status|watch|doctor|stress --config` it\n"
        "# reads it. Any spillover_* option by its name (`spillover options`), or mitmdump's.\n"
        "# After an edit: systemctl [--user] restart spillover-proxy (a new primary, port or\n"
        "# listen_host: install again, which tells the guard too).\n"
        + "".join(f"{key}: {json.dumps(value)}\n" for key, value in keys.items())
        + f"listen_host: {json.dumps(address[0])}  # where clients connect: {behind}\n"
        + f"port: {address[1]}\n"
    )
    named = f" with spillover_cards: {json.dumps(cards)}" if cards else ""
    print(f"services: wrote {settings.path}{named}")
    if settings.old is not None:
        print(f"services: the options of an earlier install, {settings.old}, are in it now")


def move_aside(old: Path) -> None:
    """mitmdump reads its confdir's config.yaml besides the settings file: an earlier
    version's goes, kept beside under another name."""
    old.rename(old.with_name(f"{old.name}.old"))
    print(f"services: {old} is not read now: moved to {old.name}.old")
