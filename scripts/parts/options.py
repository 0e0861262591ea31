"""The options `spillover run`'s mitmdump takes, as mitmproxy's and the addon's own classes
declare them, read without starting a proxy: `spillover options` lists the addon's
`spillover_*` ones, and a settings file is checked against them all."""

from __future__ import annotations

import asyncio
import re
import textwrap
from dataclasses import dataclass

from mitmproxy.exceptions import OptionsError
from mitmproxy.optmanager import OptManager, dump_dicts

from addon.surface.mistakes import PREFIX

SENTENCE_END = re.compile(r"(?<=\.)\s+(?=[A-Z])")  # not within "e.g. http://..."


@dataclass(frozen=True)
class Declared:
    """Every option mitmdump and the addon's classes declare, in an options manager of
    their own (it turns a `--set` value into the option's type as mitmdump will)."""

    options: OptManager

    def names(self) -> list[str]:
        known = self.options.keys()  # (an OptManager cannot be iterated itself)
        return sorted(name for name in known if name.startswith(PREFIX))

    def mitmproxy_names(self) -> list[str]:
        """mitmdump's own options (flow_detail, termlog_verbosity, ...)."""
        known = self.options.keys()
        return sorted(name for name in known if not name.startswith(PREFIX))

    def type_of(self, name: str) -> str:
        return dump_dicts(self.options, [name])[name]["type"]

    def check(self, name: str, *values: str) -> None:
        """Raises mitmproxy's OptionsError where `--set name=value` (once for each of
        `values`) would be refused, or a value is not among the option's choices (which
        mitmproxy checks only once the option is used)."""
        self.options.set(*(f"{name}={value}" for value in values))
        choices = dump_dicts(self.options, [name])[name]["choices"]
        if choices and (wrong := [value for value in values if value not in choices]):
            raise OptionsError(f"{wrong[0]!r} is not one of {', '.join(choices)}")

    def lines(self) -> list[str]:
        """Each option: its name, type and default, then the first sentence of its help."""
        said = []
        for name, option in dump_dicts(self.options, self.names()).items():
            first = SENTENCE_END.split(option["help"], maxsplit=1)[0]
            said.append(f"{name}  ({option['type']}, default {option['default']!r})")
            said += textwrap.wrap(first, 92, initial_indent="    ", subsequent_indent="    ")
        return said


def declared() -> Declared:
    """Load mitmdump's addons and the addon's classes as `mitmdump -s` does, without
    their start."""
    # Imported here: they take half a second, which the other commands need not wait.
    from mitmproxy.addonmanager import Loader
    from mitmproxy.addons import default_addons
    from mitmproxy.addons.dumper import Dumper
    from mitmproxy.addons.termlog import TermLog
    from mitmproxy.master import Master
    from mitmproxy.options import Options

    from addon import spillover

    loop = asyncio.new_event_loop()  # a master wants one; nothing runs on it
    try:
        master = Master(Options(), event_loop=loop)  # their load() reads mitmproxy's ctx
        termlog = TermLog()
        termlog.uninstall()  # (made, it logs to the terminal; only its option is wanted)
        loader = Loader(master)
        for addon in [*default_addons(), Dumper(), termlog, *spillover.addons]:
            if hasattr(addon, "load"):
                addon.load(loader)
    finally:
        loop.close()
    return Declared(master.options)


def main() -> None:
    print("\n".join(declared().lines()))
    print(
        "\nSet one with `spillover run ... -- --set NAME=VALUE`, or by its name (with or "
        "without spillover_) in spillover.yaml (`--config FILE`)."
    )
