"""Cached virtual environments for the peer routers that bench/peers.py compares with the gateway.

Each router is a PyPI wheel (Rust binary + thin Python launcher) pinned to one version and
installed once per machine into its own venv,
`~/.cache/deepinfer-gateway/<dist>-<version>-py<major><minor>` (DGW_PEER_VENVS overrides the
parent directory), so neither pulls its dependencies into the project's venv nor into the
other's. `python bench/peer_venvs.py` installs both and prints each interpreter.

Concurrent callers serialise on a lock file per venv; the marker file is written last, so an
interrupted install is redone from scratch.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

_MARKER = ".dgw-installed"


@dataclass(frozen=True)
class PeerRouter:
    dist: str
    version: str
    import_check: str  # a statement that fails when the install is unusable

    @property
    def pin(self) -> str:
        return f"{self.dist}=={self.version}"


SGLANG_ROUTER = PeerRouter("sglang-router", "0.3.2", "import sglang_router.launch_router")
VLLM_ROUTER = PeerRouter("vllm-router", "0.1.17", "import vllm_router")
PEER_ROUTERS = {"sglang-router": SGLANG_ROUTER, "vllm-router": VLLM_ROUTER}


class PeerInstallError(RuntimeError):
    """A peer router's venv could not be created or does not import."""


def venv_dir(router: PeerRouter) -> Path:
    parent = Path(os.environ.get("DGW_PEER_VENVS") or Path.home() / ".cache" / "deepinfer-gateway")
    return parent / f"{router.dist}-{router.version}-py{sys.version_info.major}{sys.version_info.minor}"


def ensure_venv(router: PeerRouter, log: bool = True) -> Path:
    """The venv's root, installing the pinned router first when the venv is missing or incomplete."""
    root = venv_dir(router)
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f"{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        marker = root / _MARKER
        if marker.exists() and marker.read_text().strip() == router.pin:
            return root
        _install(router, root, log)
        marker.write_text(router.pin + "\n")
    return root


def _install(router: PeerRouter, root: Path, log: bool) -> None:
    shutil.rmtree(root, ignore_errors=True)
    started = time.monotonic()
    python = str(root / "bin" / "python")
    steps = [
        [sys.executable, "-m", "venv", str(root)],
        [python, "-m", "pip", "install", "--quiet", "--upgrade", "pip"],
        [python, "-m", "pip", "install", "--quiet", router.pin],
        [python, "-c", router.import_check],
    ]
    for cmd in steps:
        if log:
            print(f"{router.dist} venv: {' '.join(cmd)}", file=sys.stderr, flush=True)
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            output = (done.stderr or done.stdout)[-2000:]
            raise PeerInstallError(f"{' '.join(cmd[:6])} exited {done.returncode}: {output}")
    if log:
        print(f"{router.dist} venv: installed in {time.monotonic() - started:.0f} s at {root}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description="Install (once) the peer routers' venvs and print their roots.")
    parser.add_argument("--routers", default=",".join(PEER_ROUTERS), help=f"comma-separated, of {list(PEER_ROUTERS)}")
    args = parser.parse_args()
    for name in args.routers.split(","):
        print(name, ensure_venv(PEER_ROUTERS[name]))


if __name__ == "__main__":
    main()
