"""What `spillover run` is to do: its flags, over a `--config FILE.yaml`, over the defaults;
every mistake in them said in one line before anything starts.

    primary: http://127.0.0.1:8081
    fallbacks: [http://127.0.0.1:8082]     # a YAML list, or one comma-separated string
    port: 8090
    listen_host: 127.0.0.1
    workers: 2                             # N proxies behind HAProxy (0: one, no HAProxy)
    free_floor_mib: 256                    # any spillover_* option, with or without the prefix

A key is written as in the file above or as its flag (`listen-host`); an option's value
is checked as mitmdump would check `--set NAME=VALUE`, which it becomes.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mitmproxy.exceptions import OptionsError
from mitmproxy.optmanager import parse

from addon.servers.keyed import keyed_mistakes
from addon.servers.urlchecks import server_mistakes
from addon.surface.mistakes import PREFIX, closest
from scripts.parts.options import Declared, declared

# `run`'s own settings, and their values when neither a flag nor the file gives them.
DEFAULTS: dict[str, Any] = {
    "primary": None,
    "fallbacks": "",
    "listen_host": "127.0.0.1",
    "port": 8090,
    "workers": 0,
}
SAME_AS = {f"{PREFIX}primary": "primary", f"{PREFIX}fallbacks": "fallbacks"}


class ConfigError(Exception):
    """A mistake in how `run` was asked to start, in one line."""


def settle(args: argparse.Namespace, extra: Sequence[str]) -> list[str]:
    """Fill `args`' settings left out on the command line from `args.config`, then from
    DEFAULTS; returns the file's options as mitmdump arguments, less those that `extra`
    (what follows `--`) sets itself."""
    settings, options = read(args.config, declared()) if args.config else ({}, {})
    for key, default in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, settings.get(key, default))
    given = set_by(extra)
    return [arg for name, value in options.items() if name not in given
            for arg in ("--set", f"{name}={value}")]  # fmt: skip


def read(path: Path, declared: Declared) -> tuple[dict[str, Any], dict[str, str]]:
    """A config file's settings of `run` and its options (name: value for `--set`)."""
    try:
        data = parse(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"--config {path}: {exc.strerror or exc}") from None
    except (OptionsError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: {' '.join(str(exc).split())}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: not a YAML mapping of keys (primary: URL, ...)")
    settings: dict[str, Any] = {}
    options: dict[str, str] = {}
    known = declared.names()
    named: dict[str, str] = {}  # each setting or option, by the key that gave it
    for key, value in data.items():
        spelled = str(key).replace("-", "_")
        name = SAME_AS.get(spelled, spelled)
        if name not in DEFAULTS:
            name = spelled if spelled.startswith(PREFIX) else PREFIX + spelled
        if name not in DEFAULTS and name not in known:
            raise ConfigError(f"{path}: unknown key {key}{hint(spelled, known)}")
        if name in named:
            raise ConfigError(f"{path}: {key} is given twice (as {named[name]} too)")
        named[name] = str(key)
        if name in DEFAULTS:
            settings[name] = setting(path, name, key, value)
        else:
            options[name] = option(path, name, key, value, declared)
    return settings, options


def hint(key: str, known: list[str]) -> str:
    """Which known key a mistyped one is closest to, written as the file writes its own."""
    close = closest(key, [*DEFAULTS, *known])
    if close is None:
        return " (`spillover options` lists the addon's)"
    return f"; did you mean {close if key.startswith(PREFIX) else close.removeprefix(PREFIX)}?"


def setting(path: Path, name: str, key: object, value: Any) -> Any:
    """One of `run`'s settings, of its type."""
    if name == "fallbacks":
        if isinstance(value, list) and all(isinstance(url, str) for url in value):
            return ",".join(value)
        if isinstance(value, str) or value is None:
            return value or ""
        raise ConfigError(f"{path}: {key} is a list of URLs (or one comma-separated string)")
    if name in ("port", "workers"):
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
        raise ConfigError(f"{path}: {key} is a number, not {value!r}")
    if isinstance(value, str) and value:
        return value
    raise ConfigError(f"{path}: {key} is {'a URL' if name == 'primary' else 'an address'}")


def option(path: Path, name: str, key: object, value: Any, declared: Declared) -> str:
    """One of the addon's options, as `--set name=...` writes it."""
    kind = declared.type_of(name)
    if kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: {key} is true or false, not {value!r}")
        text = "true" if value else "false"
    elif kind == "int":
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{path}: {key} is a whole number, not {value!r}")
        text = str(value)
    elif isinstance(value, list):  # (the options that take several take them so)
        text = ",".join(str(item) for item in value)
    elif isinstance(value, str | int | float) or value is None:
        text = "" if value is None else str(value)
    else:
        raise ConfigError(f"{path}: {key} is one value (or a list), not a mapping")
    try:
        declared.check(name, text)
    except OptionsError as exc:
        raise ConfigError(f"{path}: {key}: {exc}") from None
    return text


def set_by(extra: Sequence[str]) -> dict[str, str]:
    """The options that mitmdump arguments set (`--set NAME=VALUE`, `--set=NAME=VALUE`),
    with the last value each is given."""
    named = {}
    for at, arg in enumerate(extra):
        spec = extra[at + 1] if arg == "--set" and at + 1 < len(extra) else None
        spec = arg.removeprefix("--set=") if arg.startswith("--set=") else spec
        if spec is not None:
            name, _, value = spec.partition("=")
            named[name] = value
    return named


def mistakes(args: argparse.Namespace) -> list[str]:
    """What is wrong with the servers `run` was given, or with a primary not given."""
    if args.primary is None:
        if args.confdir is not None:
            return confdir_mistakes(args.confdir)
        if args.config is not None:
            return [f"{args.config} names no primary (primary: http://HOST:PORT), nor --primary"]
        return ["run needs --primary (or a --config file that names it)"]
    if not 0 <= args.port <= 65535:
        return [f"port {args.port} is not a port (0 to 65535)"]
    fallbacks = [url.strip() for url in args.fallbacks.split(",") if url.strip()]
    return server_mistakes([args.primary], fallbacks, [(args.listen_host, args.port)])


def named_mistakes(args: argparse.Namespace, extra: Sequence[str]) -> list[str]:
    """What is wrong with the options that name servers (addon/servers/keyed.py) as the
    settings file and mitmdump's arguments give them: an entry that names no server
    `run` was given, said before mitmdump starts (its addon says the same of a confdir's)."""
    if args.primary is None:
        return []
    fallbacks = [url.strip() for url in args.fallbacks.split(",") if url.strip()]
    servers = [url.rstrip("/") for url in (args.primary, *fallbacks)]
    return keyed_mistakes(set_by(extra), servers)


def confdir_mistakes(confdir: Path) -> list[str]:
    """Without --primary, a confdir's config.yaml must name it: else mitmdump would start
    a plain forward proxy that carries nothing of the addon's."""
    options = confdir / "config.yaml"
    try:
        data = parse(options.read_text(encoding="utf-8")) or {}
    except OSError as exc:
        return [f"--confdir {confdir}: no {options.name} to name the primary ({exc.strerror}): "
                "give --primary or --config"]  # fmt: skip
    except (OptionsError, UnicodeDecodeError) as exc:
        return [f"{options}: {' '.join(str(exc).split())}"]
    data = data if isinstance(data, dict) else {}
    modes = data.get("mode") or []
    modes = [modes] if isinstance(modes, str) else modes
    if data.get(f"{PREFIX}primary") or any(str(mode).startswith("reverse:") for mode in modes):
        return []
    return [f"{options} names no primary (mode: [reverse:URL] or {PREFIX}primary): "
            "give --primary or --config"]  # fmt: skip
