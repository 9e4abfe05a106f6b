"""Separate "hosts" on one machine for bench/chaos.py: network namespaces joined by veth pairs
to a bridge that lives in a namespace of its own.

Each host is a namespace `<run>-<host>` with `lo` and `eth0` (an address of SUBNET, /24) and
no route beyond that subnet: its processes reach the other hosts and their own loopback,
nothing else. The machine's own namespace is not on the bridge, and the bridge lives in the
switch namespace `<run>-sw`, so cutting a host off (`set_link(host, up=False)`) is `ip link
set down` on its bridge port, as a pulled cable: packets are dropped, nobody is told.
`/etc/netns/<namespace>/hosts` names every host (`ip netns exec` bind-mounts it over
/etc/hosts), so a shipped config can say `redis` as docker compose's does.

A run's names start with `dgwc<pid>-`. `Lab.destroy` kills every process still inside the
run's namespaces (all started by the run) and deletes them; `sweep_stale` does the same for
runs whose process is gone (killed outright, no `finally` ran). Needs root and iproute2.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

PREFIX = "dgwc"
SUBNET = "10.77.0"  # private to a run: no other namespace has an address on its bridge
FIRST_HOST = 10
SWITCH = "sw"
BRIDGE = "br0"
NETNS_ETC = Path("/etc/netns")
_HOST_NAME = re.compile(r"^[a-z][a-z0-9]{0,11}$")  # the bridge port "p-<host>" fits IFNAMSIZ (15)
_RUN_OF = re.compile(rf"^{PREFIX}(\d+)-")


@dataclass(frozen=True)
class Host:
    name: str
    netns: str
    ip: str

    @property
    def port_name(self) -> str:
        """Its veth end on the bridge, in the switch namespace."""
        return f"p-{self.name}"


def run_name(pid: int) -> str:
    return f"{PREFIX}{pid}"


def plan(run: str, names: Sequence[str]) -> dict[str, Host]:
    """Namespace and address of each host, in order: SUBNET.10, .11, ..."""
    if not re.fullmatch(rf"{PREFIX}\d+", run):
        raise ValueError(f"run name {run!r} is not {PREFIX}<pid>")
    if len(set(names)) != len(names) or SWITCH in names:
        raise ValueError(f"host names must be distinct and not {SWITCH!r}: {names}")
    if len(names) > 250 - FIRST_HOST:
        raise ValueError("too many hosts for one /24")
    for name in names:
        if not _HOST_NAME.fullmatch(name):
            raise ValueError(f"host name {name!r}: a lowercase letter then up to 11 letters or digits")
    return {name: Host(name, f"{run}-{name}", f"{SUBNET}.{FIRST_HOST + i}") for i, name in enumerate(names)}


def hosts_file(hosts: Iterable[Host]) -> str:
    """/etc/hosts of every host: loopback, then each host by its name."""
    lines = ["127.0.0.1 localhost", "::1 localhost"] + [f"{h.ip} {h.name}" for h in hosts]
    return "\n".join(lines) + "\n"


def run_of(netns: str) -> int | None:
    """The pid of the run that made a namespace, None for a namespace that is not a run's."""
    match = _RUN_OF.match(netns)
    return int(match.group(1)) if match else None


def stale_namespaces(namespaces: Iterable[str], alive: Callable[[int], bool]) -> list[str]:
    """The run namespaces whose run process is gone."""
    return [ns for ns in namespaces if (pid := run_of(ns)) is not None and not alive(pid)]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def list_namespaces() -> list[str]:
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def kill_inside(netns: str) -> None:
    """SIGKILL every process in a namespace (a run's own processes) and wait until none is left."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            pids = [int(p) for p in ip("netns", "pids", netns).split()]
        except RuntimeError:  # already deleted
            return
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def delete_namespace(netns: str) -> None:
    kill_inside(netns)
    if netns in list_namespaces():
        ip("netns", "delete", netns)  # its veth ends (and the bridge, in the switch) go with it
    shutil.rmtree(NETNS_ETC / netns, ignore_errors=True)


def sweep_stale() -> list[str]:
    """Delete what runs killed outright left behind; the names deleted."""
    stale = stale_namespaces(list_namespaces(), _pid_alive)
    for netns in stale:
        delete_namespace(netns)
    for leftover in NETNS_ETC.glob(f"{PREFIX}*") if NETNS_ETC.is_dir() else ():
        if (pid := run_of(leftover.name)) is not None and not _pid_alive(pid):
            shutil.rmtree(leftover, ignore_errors=True)
    return stale


class Lab:
    """One run's hosts. `create()` builds them; a process that did not create them (the
    driver inside the client host) uses the same `Lab(run, names)` to reach them."""

    def __init__(self, run: str, names: Sequence[str]):
        self.run = run
        self.hosts = plan(run, names)
        self.switch = f"{run}-{SWITCH}"

    def create(self) -> None:
        try:
            self._create()
        except BaseException:
            self.destroy()
            raise

    def _create(self) -> None:
        sw = self.switch
        ip("netns", "add", sw)
        ip("-n", sw, "link", "set", "lo", "up")
        ip("-n", sw, "link", "add", BRIDGE, "type", "bridge")
        ip("-n", sw, "link", "set", BRIDGE, "up")
        text = hosts_file(self.hosts.values())
        for host in self.hosts.values():
            ip("netns", "add", host.netns)
            ip("-n", sw, "link", "add", host.port_name, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
            ip("-n", sw, "link", "set", host.port_name, "master", BRIDGE, "up")
            ip("-n", host.netns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
            ip("-n", host.netns, "link", "set", "eth0", "up")
            ip("-n", host.netns, "link", "set", "lo", "up")
            etc = NETNS_ETC / host.netns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(text)

    def write_etc(self, host: str, name: str, text: str) -> None:
        """A file that `ip netns exec` bind-mounts over /etc/<name> for the host's processes
        started from now on (resolv.conf, hosts)."""
        (NETNS_ETC / self.hosts[host].netns / name).write_text(text)

    def exec_prefix(self, host: str) -> list[str]:
        """Prepended to a command line to run it on `host` (the same pid: ip execs the command)."""
        return ["ip", "netns", "exec", self.hosts[host].netns]

    def set_link(self, host: str, up: bool) -> None:
        ip("-n", self.switch, "link", "set", self.hosts[host].port_name, "up" if up else "down")

    def destroy(self) -> None:
        """Kill what runs on the hosts, then delete them; never raises for a part already gone."""
        errors = []
        for netns in [h.netns for h in self.hosts.values()] + [self.switch]:
            try:
                delete_namespace(netns)
            except RuntimeError as exc:
                errors.append(str(exc))
        if errors:
            raise RuntimeError("; ".join(errors))


def netns_usable() -> str | None:
    """None when this process can make namespaces, else why not."""
    if os.geteuid() != 0:
        return "needs root (ip netns add)"
    if shutil.which("ip") is None:
        return "needs iproute2's ip"
    probe = f"{run_name(os.getpid())}-probe"
    try:
        ip("netns", "add", probe)
    except RuntimeError as exc:
        return str(exc)
    delete_namespace(probe)
    return None
