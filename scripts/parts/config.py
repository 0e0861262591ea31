"""One settings file for every command, `spillover.yaml`: `run` and `services install`
start the proxy from it; `status`, `watch`, `doctor` and `stress` take the proxy's
address, the servers and their cards from it. Each reads the file `--config` names,
else `./spillover.yaml` where there is one (and says so); the flags given win over it.

    primary: http://127.0.0.1:8081
    fallbacks: [http://127.0.0.1:8082]     # a YAML list, or one comma-separated string
    port: 8090                             # where clients connect
    listen_host: 127.0.0.1
    workers: 2                             # N proxies behind HAProxy (0: one, no HAProxy)
    free_floor_mib: 256                    # any spillover_* option, with or without the prefix
    flow_detail: 1                         # and mitmdump's own options, by their names

A key is written as in the file above or as its flag (`listen-host`); an option's value
is checked as mitmdump would check `--set NAME=VALUE`, which it becomes. A key that is
none of these is refused by every command, each mistake in one line.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mitmproxy.exceptions import OptionsError
from mitmproxy.optmanager import parse

from addon.servers.keyed import keyed_mistakes
from addon.servers.urlchecks import server_mistakes
from addon.surface.mistakes import PREFIX, closest
from scripts.parts.options import Declared, declared

FILE = Path("spillover.yaml")  # read from the current folder where no --config is given
HELP = f"the settings file (default: ./{FILE} where there is one; the flags given win)"
# `run`'s own settings, and their values when neither a flag nor the file gives them.
DEFAULTS: dict[str, Any] = {
    "primary": None,
    "fallbacks": "",
    "listen_host": "127.0.0.1",
    "port": 8090,
    "workers": 0,
}
SAME_AS = {f"{PREFIX}primary": "primary", f"{PREFIX}fallbacks": "fallbacks"}
# mitmdump's options that `run` sets itself: a file that set them would fight it.
SET_BY_RUN = {
    "mode": "spillover run sets it from primary, listen_host and port",
    "listen_port": "the port is port here",
    "scripts": "spillover run loads the addon itself",
    "confdir": "give --confdir",
}
# `run`'s log holds handoffs, warnings and errors unless -v (or the file) says otherwise.
QUIET = {"flow_detail": "0", f"{PREFIX}log_connections": "false"}


class ConfigError(Exception):
    """Mistakes in a settings file, or in how `run` was asked to start, one line each."""

    def __init__(self, lines: Sequence[str]) -> None:
        super().__init__("\n".join(lines))
        self.lines = list(lines)


class Wrong(ValueError):
    """One key's mistake."""


@dataclass(frozen=True)
class Config:
    """What a settings file says (nothing, where none was read)."""

    path: Path | None = None
    settings: dict[str, Any] = field(default_factory=dict)  # run's own: primary, port, ...
    options: dict[str, list[str]] = field(default_factory=dict)  # each option's --set values

    def get(self, name: str) -> Any:
        return self.settings.get(name, DEFAULTS[name])

    def option(self, name: str) -> str | None:
        """A spillover_* option's value (named with or without the prefix) as `--set`
        gives it; None where the file sets none."""
        values = self.options.get(name if name.startswith(PREFIX) else PREFIX + name)
        return None if values is None else ",".join(values)

    def servers(self) -> list[str]:
        """The primary (where the file names one), then the fallbacks."""
        fallbacks = [url.strip() for url in self.get("fallbacks").split(",") if url.strip()]
        return [self.get("primary"), *fallbacks] if self.get("primary") else fallbacks

    def proxy_url(self) -> str:
        """Where a command on this machine reaches the proxy the file describes."""
        host = self.get("listen_host")
        host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
        return f"http://{f'[{host}]' if ':' in host else host}:{self.get('port')}"

    def set_args(self, given: Collection[str]) -> list[str]:
        """The file's options as mitmdump arguments, less those named in `given`."""
        return [arg for name, values in self.options.items() if name not in given
                for value in values for arg in ("--set", f"{name}={value}")]  # fmt: skip


def found(named: Path | None) -> Path | None:
    """The file a command reads: the one named, else ./spillover.yaml where there is one."""
    return named if named is not None or not FILE.is_file() else FILE


def load(named: Path | None, said_by: str) -> Config:
    """The settings file a command reads (an empty Config where there is none); where it
    holds mistakes, each is said in one line (`said_by`: the command) and it exits 2."""
    path = found(named)
    if path is None:
        return Config()
    if named is None:
        print(f"{said_by}: settings from {path.resolve()}", file=sys.stderr)
    try:
        return read(path, declared())
    except ConfigError as exc:
        for line in exc.lines:
            print(f"{said_by}: {line}", file=sys.stderr)
        sys.exit(2)


def with_config(
    parser: argparse.ArgumentParser, said_by: str, defaults: Callable[[Config], dict[str, Any]]
) -> tuple[argparse.Namespace, Config]:
    """The command line, where what the flags leave out comes from the settings file
    (`defaults`: the file's values by flag, None for none)."""
    parser.add_argument("--config", type=Path, metavar="FILE.yaml", help=HELP)
    config = load(parser.parse_known_args()[0].config, said_by)
    parser.set_defaults(**{k: v for k, v in defaults(config).items() if v is not None})
    return parser.parse_args(), config


def read(path: Path, declared: Declared) -> Config:
    try:
        data = parse(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError([f"--config {path}: {exc.strerror or exc}"]) from None
    except (OptionsError, UnicodeDecodeError) as exc:
        raise ConfigError([f"{path}: {' '.join(str(exc).split())}"]) from None
    return from_data(path, data, declared)


def from_data(path: Path, data: object, declared: Declared) -> Config:
    """The settings and options a file's keys give, or every mistake in them."""
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: not a YAML mapping of keys (primary: URL, ...)"])
    settings: dict[str, Any] = {}
    options: dict[str, list[str]] = {}
    named: dict[str, str] = {}  # each setting or option, by the key that gave it
    mistakes = []
    for key, value in data.items():
        try:
            name = meant(str(key), declared)
            if name in named:
                raise Wrong(f"{key} is given twice (as {named[name]} too)")
            named[name] = str(key)
            if name in DEFAULTS:
                settings[name] = setting(name, key, value)
            else:
                options[name] = option(name, key, value, declared)
        except Wrong as exc:
            mistakes.append(f"{path}: {exc}")
    if mistakes:
        raise ConfigError(mistakes)
    return Config(path, settings, options)


def meant(key: str, declared: Declared) -> str:
    """The setting or option a key names: run's own, then mitmdump's by its own name,
    then the addon's with or without the prefix."""
    spelled = key.replace("-", "_")
    name = SAME_AS.get(spelled, spelled)
    if name in DEFAULTS:
        return name
    if name in SET_BY_RUN:
        raise Wrong(f"{key}: {SET_BY_RUN[name]}")
    if name in declared.mitmproxy_names():
        return name
    name = spelled if spelled.startswith(PREFIX) else PREFIX + spelled
    if name in declared.names():
        return name
    raise Wrong(f"unknown key {key}{hint(spelled, declared)}")


def hint(key: str, declared: Declared) -> str:
    """Which known key a mistyped one is closest to, written as the file writes its own."""
    if key.startswith(("web_", "console_")):
        return ": mitmweb's option (or the console's), and spillover run starts mitmdump"
    close = closest(key, [*DEFAULTS, *declared.names(), *declared.mitmproxy_names()])
    if close is None:
        return " (`spillover options` lists the addon's)"
    return f"; did you mean {close if key.startswith(PREFIX) else close.removeprefix(PREFIX)}?"


def setting(name: str, key: object, value: Any) -> Any:
    """One of `run`'s settings, of its type."""
    if name == "fallbacks":
        if isinstance(value, list) and all(isinstance(url, str) for url in value):
            return ",".join(value)
        if isinstance(value, str) or value is None:
            return value or ""
        raise Wrong(f"{key} is a list of URLs (or one comma-separated string)")
    if name in ("port", "workers"):
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
        raise Wrong(f"{key} is a number, not {value!r}")
    if isinstance(value, str) and value:
        return value
    raise Wrong(f"{key} is {'a URL' if name == 'primary' else 'an address'}")


def option(name: str, key: object, value: Any, declared: Declared) -> list[str]:
    """One option's values, as `--set name=...` (once each) writes them."""
    kind = declared.type_of(name)
    if kind == "bool":
        if not isinstance(value, bool):
            raise Wrong(f"{key} is true or false, not {value!r}")
        texts = ["true" if value else "false"]
    elif kind in ("int", "optional int"):
        if not (isinstance(value, int) and not isinstance(value, bool)) and not (
            value is None and kind == "optional int"
        ):
            raise Wrong(f"{key} is a whole number, not {value!r}")
        texts = ["" if value is None else str(value)]
    elif kind == "sequence of str" and isinstance(value, list | str):
        texts = [str(item) for item in ([value] if isinstance(value, str) else value)]
    elif isinstance(value, list):  # (the addon's options that take several take them so)
        texts = [",".join(str(item) for item in value)]
    elif isinstance(value, str | int | float) or value is None:
        texts = ["" if value is None else str(value)]
    else:
        raise Wrong(f"{key} is one value (or a list), not a mapping")
    try:
        declared.check(name, *texts)
    except OptionsError as exc:
        raise Wrong(f"{key}: {exc}") from None
    return texts


def settle(args: argparse.Namespace, extra: Sequence[str]) -> list[str]:
    """Fill `args`' settings left out on the command line from the settings file, then
    from DEFAULTS; returns the file's options as mitmdump arguments, less those that
    `extra` (what follows `--`) sets itself, and the quiet log's unless `args.verbose`."""
    config = load(args.config, "spillover run")
    args.config = config.path
    for key in DEFAULTS:
        if getattr(args, key) is None:
            setattr(args, key, config.get(key))
    given = set_by(extra)
    quiet = {} if args.verbose else QUIET
    return config.set_args(given) + [arg for name, value in quiet.items()
        if name not in given and name not in config.options
        for arg in ("--set", f"{name}={value}")]  # fmt: skip


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
