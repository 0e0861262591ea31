"""The programs docs/beside.md runs beside the proxy, each installed once from PyPI into a
virtual environment of its own under the cache (their pins stay out of the project's):
LiteLLM's proxy, a gateway in front of spillover (about a minute, 740 MB), and RAMP, a
daemon that swaps the model behind its port (seconds). llama-swap and Ollama are not in
the registries this project's machines reach, so their recipes are not run here.

    python -m scripts.testbed.beside    # install what is missing; print each command
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from scripts.testbed.llamabin import CACHE

# name: (what pip installs, the command it brings)
TOOLS = {
    "litellm": ("litellm[proxy]==1.108.7", "litellm"),
    "ramp": ("ramp-llm==0.7.0", "ramp"),
}


class ToolUnavailable(RuntimeError):
    """The tool could not be installed here; the message says why."""


def command(name: str) -> Path:
    """The tool's command, installing it first where it is missing."""
    package, program = TOOLS[name]
    home = CACHE / package.replace("[", "-").replace("]", "").replace("==", "-")
    done = home / ".installed"
    if not done.exists():
        print(f"beside: installing {package} (once)", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(home)], check=True)
        pip = [str(home / "bin" / "python"), "-m", "pip", "install", "-q"]
        installed = subprocess.run(
            [*pip, "--disable-pip-version-check", package], capture_output=True, text=True
        )
        if installed.returncode != 0:
            raise ToolUnavailable(f"pip could not install {package}: {installed.stderr[-500:]}")
        done.write_text(package)
    return home / "bin" / program


if __name__ == "__main__":
    for tool in TOOLS:
        try:
            print(command(tool))
        except ToolUnavailable as why:
            print(f"beside: {why}; its recipe's test will be skipped", file=sys.stderr)
