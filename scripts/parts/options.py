"""The addon's `spillover_*` options as its own classes declare them, read without starting
a proxy: `spillover options` lists them, and a `--config` file is checked against them."""

from __future__ import annotations

import asyncio
import re
import textwrap
from dataclasses import dataclass

from mitmproxy.optmanager import OptManager, dump_dicts

from addon.surface.mistakes import PREFIX

SENTENCE_END = re.compile(r"(?<=\.)\s+(?=[A-Z])")  # not within "e.g. http://..."


@dataclass(frozen=True)
class Declared:
    """Every option the addon's classes declare, in an options manager of their own (it
    turns a `--set` value into the option's type as mitmdump will)."""

    options: OptManager

    def names(self) -> list[str]:
        known = self.options.keys()  # (an OptManager cannot be iterated itself)
        return sorted(name for name in known if name.startswith(PREFIX))

    def type_of(self, name: str) -> str:
        return dump_dicts(self.options, [name])[name]["type"]

    def check(self, name: str, value: str) -> None:
        """Raises mitmproxy's OptionsError where `--set name=value` would be refused."""
        self.options.set(f"{name}={value}")

    def lines(self) -> list[str]:
        """Each option: its name, type and default, then the first sentence of its help."""
        said = []
        for name, option in dump_dicts(self.options, self.names()).items():
            first = SENTENCE_END.split(option["help"], maxsplit=1)[0]
            said.append(f"{name}  ({option['type']}, default {option['default']!r})")
            said += textwrap.wrap(first, 92, initial_indent="    ", subsequent_indent="    ")
        return said


def declared() -> Declared:
    """Load the addon's classes as `mitmdump -s` does, without their start."""
    # Imported here: they take half a second, which the other commands need not wait.
    from mitmproxy.addonmanager import Loader
    from mitmproxy.master import Master

    from addon import spillover

    loop = asyncio.new_event_loop()  # a master wants one; nothing runs on it
    try:
        master = Master(OptManager(), event_loop=loop)  # their load() reads mitmproxy's ctx
        loader = Loader(master)
        for addon in spillover.addons:
            addon.load(loader)
    finally:
        loop.close()
    return Declared(master.options)


def main() -> None:
    print("\n".join(declared().lines()))
    print(
        "\nSet one with `spillover run ... -- --set NAME=VALUE`, or by its name (with or "
        "without spillover_) in a `spillover run --config` file."
    )
