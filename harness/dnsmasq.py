"""A real DNS server for tests and benchmarks: dnsmasq on a loopback port, answering A/AAAA
records from a hosts file it re-reads on SIGHUP (so a pool "scales" by rewriting the file),
and SRV records given at start. Debian's dnsmasq-base provides the binary
(system-packages.txt); it runs unprivileged on a port above 1024, without a daemon, a
resolv.conf or /etc/hosts, and answers NXDOMAIN for names of its `domain` it does not hold,
as a cluster DNS does for a Service without endpoints."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

DNSMASQ_PATHS = ("/usr/sbin/dnsmasq", "/sbin/dnsmasq")


class NoDnsmasq(RuntimeError):
    pass


class AddressInUse(RuntimeError):
    pass


def dnsmasq_binary() -> str:
    """The dnsmasq executable; NoDnsmasq if not installed."""
    found = shutil.which("dnsmasq") or next((p for p in DNSMASQ_PATHS if os.access(p, os.X_OK)), None)
    if found is None:
        raise NoDnsmasq("dnsmasq not found (Debian: apt-get install dnsmasq-base; `make` installs it)")
    return found


def free_udp_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Dnsmasq:
    """dnsmasq serving `domain` on `host:port` (UDP and TCP; a free port when 0)."""

    def __init__(self, workdir: Path, domain: str = "dgw.test", host: str = "127.0.0.1", port: int = 0,
                 srv: Iterable[tuple[str, str, int]] = ()):
        """srv: (SRV name, target host name, port) records, fixed for the server's life."""
        self.host = host
        self._domain, self._srv = domain, list(srv)
        self._workdir = workdir
        for attempt in range(5):  # a free UDP port may be taken for TCP: another one then
            self.port = port or free_udp_port(host)
            try:
                self._start()
                return
            except AddressInUse:
                if port or attempt == 4:
                    raise

    def _start(self) -> None:
        self.hosts_file = self._workdir / f"dnsmasq-{self.port}.hosts"
        self.hosts_file.write_text("")
        self.log_file = self._workdir / f"dnsmasq-{self.port}.log"
        cmd = [dnsmasq_binary(), "--no-daemon", "--no-resolv", "--no-hosts", "--bind-interfaces",
               f"--listen-address={self.host}", f"--port={self.port}", f"--addn-hosts={self.hosts_file}",
               f"--local=/{self._domain}/", "--local-ttl=0", "--cache-size=0",
               f"--log-facility={self.log_file}"]
        cmd += [f"--srv-host={name},{target},{port}" for name, target, port in self._srv]
        with open(self.log_file, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._wait_listening()

    @property
    def nameserver(self) -> str:
        """As `[[discovery]] nameservers` takes it."""
        return f"{self.host}:{self.port}"

    def set_records(self, records: Mapping[str, Iterable[str]]) -> None:
        """Serve exactly these names -> addresses from now on (every other name: NXDOMAIN)."""
        lines = [f"{address} {name}" for name, addresses in records.items() for address in addresses]
        tmp = self.hosts_file.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(self.hosts_file)
        self.proc.send_signal(signal.SIGHUP)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def _wait_listening(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                text = self.log_file.read_text()
                if "Address already in use" in text:
                    raise AddressInUse(text[-300:])
                raise RuntimeError(f"dnsmasq exited with {self.proc.returncode}: {self.log_file.read_text()[-500:]}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2):  # it serves TCP too
                    return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"dnsmasq not listening on {self.host}:{self.port} after {timeout}s")
