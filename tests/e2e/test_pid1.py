"""The gateway as PID 1 of a container without an init (Kubernetes): run in a new PID
namespace (`unshare --pid --fork --mount-proc`, util-linux, as root), it stops cleanly on
SIGTERM and reaps the orphans re-parented to it. Under CI=true it never skips."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from harness.launch import CLI, free_port, wait_for_port


def require_namespaces() -> None:
    missing = [tool for tool in ("unshare", "nsenter") if shutil.which(tool) is None]
    why = f"missing {missing}" if missing else ("needs root for PID namespaces" if os.geteuid() != 0 else "")
    if why:
        if os.environ.get("CI") == "true":
            pytest.fail(f"PID 1 test: {why}; CI must never skip it")
        pytest.skip(why)


def status_field(pid: int, field: str) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return line.split(":", 1)[1].strip()
    raise KeyError(field)


def namespace_init(unshare_pid: int, timeout: float = 10.0) -> int:
    """The host pid of PID 1 in the namespace `unshare --fork` made (its only child)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        children = Path(f"/proc/{unshare_pid}/task/{unshare_pid}/children").read_text().split()
        if children:
            (pid,) = (int(c) for c in children)
            assert status_field(pid, "NSpid").split()[-1] == "1"
            return pid
        time.sleep(0.05)
    raise AssertionError("unshare started no child")


def zombies_in_namespace(init_pid: int) -> list[int]:
    ns = os.readlink(f"/proc/{init_pid}/ns/pid")
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(entry / "ns" / "pid") == ns and status_field(int(entry.name), "State").startswith("Z"):
                found.append(int(entry.name))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return found


def test_gateway_as_pid1_reaps_orphans_and_stops_on_sigterm(tmp_path: Path) -> None:
    require_namespaces()
    port = free_port()
    config = tmp_path / "gateway.toml"
    config.write_text(f"port = {port}\nshutdown_delay_s = 0\n\n[[workers]]\nurl = \"http://127.0.0.1:{free_port()}\"\n")
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", *CLI, "serve", "--config", str(config)],
                            start_new_session=True)
    try:
        init = namespace_init(proc.pid)
        wait_for_port(port, timeout=60)
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200

        # An orphan: a shell in the namespace starts `sleep` and exits; the kernel gives the
        # sleep to the namespace's PID 1.
        done = subprocess.run(["nsenter", "--target", str(init), "--pid", "--mount", "--",
                               "sh", "-c", "sleep 3 >/dev/null 2>&1 & echo $!"],
                              capture_output=True, text=True, timeout=10)
        assert done.returncode == 0, done.stderr
        orphan_ns_pid = int(done.stdout)
        orphans = [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()
                   and _ns_pid(int(e.name)) == orphan_ns_pid and _same_ns(int(e.name), init)]
        assert len(orphans) == 1
        (orphan,) = orphans
        assert int(status_field(orphan, "PPid")) == init  # re-parented to PID 1

        deadline = time.monotonic() + 10
        while Path(f"/proc/{orphan}").exists():  # a zombie keeps its /proc entry until reaped
            assert time.monotonic() < deadline, f"orphan {orphan} not reaped: {zombies_in_namespace(init)}"
            time.sleep(0.05)
        assert zombies_in_namespace(init) == []

        os.kill(init, signal.SIGTERM)
        assert proc.wait(timeout=30) == 0  # the gateway drained and exited 0; PID 1 passed that on
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _ns_pid(pid: int) -> int | None:
    try:
        return int(status_field(pid, "NSpid").split()[-1])
    except (FileNotFoundError, ProcessLookupError, PermissionError, ValueError):
        return None


def _same_ns(pid: int, init: int) -> bool:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid") == os.readlink(f"/proc/{init}/ns/pid")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False
