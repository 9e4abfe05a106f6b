"""Which addresses a worker added at run time (`POST /admin/workers`, or read back from the
shared admin state) may point at.

Every call to a worker carries the workers' token, so a worker entry is a destination the
gateway hands that token to: an admin key able to name any URL could send it anywhere.
A run-time worker is admitted when every address it names (its URL and, for vLLM, its KV
events endpoints) is

- an address of a configured `[[workers]]` entry, exactly (scheme, host and port): adding a
  removed configured worker back, or changing its role or pool, sends nothing new anywhere;
- or at a host the `admin_worker_hosts` setting lists: a host name, matched as written
  (never resolved: a listed name's address may change, an unlisted name that resolves into
  a listed network is still refused), or an IP address inside a listed CIDR.

Empty `admin_worker_hosts` (the default) therefore admits only the configured workers' own
addresses. Workers found by discovery are the deployment's own and are not checked here.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from yarl import URL

from deepinfer_gateway.config import VllmWorkerSpec, WorkerSpec
from deepinfer_gateway.core.errors import GatewayError

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class WorkerNotAllowed(GatewayError):
    status_code = 400

    def __init__(self, message: str):
        super().__init__(message, code="worker_not_allowed", param="url")


def worker_addresses(spec: WorkerSpec) -> tuple[str, ...]:
    """Every address the gateway contacts for this worker (the workers' token goes to the URL)."""
    out = [spec.url]
    if isinstance(spec, VllmWorkerSpec):
        out += [a for a in (spec.kv_events_endpoint, spec.kv_events_replay_endpoint) if a]
    return tuple(out)


def _origin(address: str) -> tuple[str, str, int | None] | None:
    """(scheme, host, port) as the HTTP client parses the address; None when it names no host."""
    try:
        url = URL(address)
    except ValueError:
        return None
    if not url.host:
        return None
    return url.scheme.lower(), url.host.lower().rstrip("."), url.port


@dataclass(frozen=True)
class WorkerAllowList:
    hosts: frozenset[str]
    networks: tuple[Network, ...]
    configured: frozenset[tuple[str, str, int | None]]  # the configured workers' own addresses

    @classmethod
    def build(cls, entries: Iterable[str], configured: Iterable[WorkerSpec]) -> WorkerAllowList:
        hosts: set[str] = set()
        networks: list[Network] = []
        for entry in entries:
            try:
                networks.append(ipaddress.ip_network(entry.strip(), strict=False))
            except ValueError:
                hosts.add(entry.strip().lower().rstrip("."))
        origins = {("ipc", a, None) if a.startswith("ipc://") else _origin(a)
                   for spec in configured for a in worker_addresses(spec)}
        return cls(frozenset(hosts), tuple(networks), frozenset(o for o in origins if o is not None))

    def refusal(self, spec: WorkerSpec) -> str | None:
        """Why this worker may not be added (naming the first address refused), or None."""
        for address in worker_addresses(spec):
            if address.startswith("ipc://"):  # a ZMQ socket on this host (vLLM's KV events): local, as loopback
                if ("ipc", address, None) not in self.configured and not self._admits("127.0.0.1"):
                    return f"{address} is a socket on this host, and admin_worker_hosts does not admit loopback"
                continue
            origin = _origin(address)
            if origin is None:
                return "an address names no host"
            if origin not in self.configured and not self._admits(origin[1]):
                scheme, host, port = origin
                return (f"{scheme}://{host}:{port} is neither a configured worker's address nor at a host "
                        "admin_worker_hosts lists")
        return None

    def _admits(self, host: str) -> bool:
        if host in self.hosts:
            return True
        try:
            ip = ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
        except ValueError:
            return False  # a name: only as written
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(ip.version == net.version and ip in net for net in self.networks)

    def check(self, spec: WorkerSpec) -> None:
        """Raise WorkerNotAllowed (400) unless this worker may be added."""
        why = self.refusal(spec)
        if why is not None:
            raise WorkerNotAllowed(f"Worker {spec.worker_id!r} not added: {why}.")
