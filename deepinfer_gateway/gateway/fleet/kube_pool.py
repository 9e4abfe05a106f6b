"""An InferencePool's workers from Kubernetes objects, pure (no I/O): what kube_discovery.py
reads through the API server becomes a set of `Endpoint`s here.

- `pool_spec`: an InferencePool (inference.networking.k8s.io/v1) -> its selector's labels and
  its targetPorts (each port of a pod is one worker: a pod may serve several engine ranks).
- `pod_endpoints`: a pod -> its endpoints if it serves: Ready condition True, an IP, not
  terminating (a pod with a deletionTimestamp is draining: it leaves the set at once, as a
  Service's endpoints drop it), else none.
- `PodSet`: the endpoints of the pods a list answered, kept current by the watch events after
  it (ADDED, MODIFIED, DELETED; BOOKMARK moves the resourceVersion only).
- `WatchEvent.parse`: one line of a watch stream; `expired`: the ERROR event (HTTP 410 Gone)
  that says the resourceVersion is too old, so the client lists again.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from deepinfer_gateway.gateway.fleet.endpoints import Endpoint

GONE = 410  # the HTTP status (and a watch ERROR's code) of a resourceVersion the server no longer has


class BadObject(ValueError):
    """An object without the fields its kind must have (a server or a CRD we do not speak)."""


@dataclass(frozen=True)
class PoolSpec:
    """What an InferencePool says of its endpoints."""

    labels: tuple[tuple[str, str], ...]  # selector.matchLabels, sorted
    ports: tuple[int, ...]  # targetPorts' numbers, in order

    @property
    def label_selector(self) -> str:
        """The list and watch requests' labelSelector: every label, equal."""
        return ",".join(f"{key}={value}" for key, value in self.labels)


def pool_spec(pool: Mapping[str, Any]) -> PoolSpec:
    """An InferencePool object (v1) -> its selector and ports; BadObject if it has neither."""
    spec = pool.get("spec") or {}
    labels = (spec.get("selector") or {}).get("matchLabels") or {}
    ports = tuple(p.get("number") for p in spec.get("targetPorts") or [])
    if not labels or not all(isinstance(v, str) for v in labels.values()):
        raise BadObject(f"InferencePool {name_of(pool)}: spec.selector.matchLabels must name labels")
    if not ports or not all(isinstance(p, int) and 0 < p < 65536 for p in ports):
        raise BadObject(f"InferencePool {name_of(pool)}: spec.targetPorts must list port numbers")
    return PoolSpec(tuple(sorted(labels.items())), ports)


def name_of(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name", "?"))


def resource_version(obj: Mapping[str, Any]) -> str:
    version = (obj.get("metadata") or {}).get("resourceVersion")
    if not isinstance(version, str) or not version:
        raise BadObject(f"{obj.get('kind', 'object')} {name_of(obj)}: no metadata.resourceVersion")
    return version


def pod_endpoints(pod: Mapping[str, Any], ports: Iterable[int]) -> set[Endpoint]:
    """The pod's endpoints, one per port, while it serves; none otherwise."""
    metadata = pod.get("metadata") or {}
    status = pod.get("status") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    ip = status.get("podIP")
    if not ready or not ip or metadata.get("deletionTimestamp"):
        return set()
    return {Endpoint(str(ip), port) for port in ports}


def _uid(pod: Mapping[str, Any]) -> str:
    metadata = pod.get("metadata") or {}
    uid = metadata.get("uid") or f"{metadata.get('namespace', '')}/{metadata.get('name', '')}"
    return str(uid)


@dataclass
class PodSet:
    """The endpoints of the watched pods, by pod uid (a pod replaced under the same name is another pod)."""

    ports: tuple[int, ...]
    _by_pod: dict[str, set[Endpoint]] = field(default_factory=dict)

    def replace(self, pods: Iterable[Mapping[str, Any]]) -> None:
        """A list's answer: exactly these pods."""
        self._by_pod = {_uid(pod): pod_endpoints(pod, self.ports) for pod in pods}

    def apply(self, event: WatchEvent) -> None:
        if event.type in ("ADDED", "MODIFIED"):
            self._by_pod[_uid(event.object)] = pod_endpoints(event.object, self.ports)
        elif event.type == "DELETED":
            self._by_pod.pop(_uid(event.object), None)

    def endpoints(self) -> set[Endpoint]:
        return set().union(*self._by_pod.values())


@dataclass(frozen=True)
class WatchEvent:
    type: str  # ADDED, MODIFIED, DELETED, BOOKMARK or ERROR
    object: dict[str, Any]

    @classmethod
    def parse(cls, line: bytes | str) -> WatchEvent:
        try:
            raw = json.loads(line)
        except ValueError as exc:
            raise BadObject(f"watch: not a JSON event: {exc}") from None
        if not isinstance(raw, dict) or not isinstance(raw.get("type"), str) or not isinstance(raw.get("object"), dict):
            raise BadObject(f"watch: not an event: {str(line)[:200]}")
        return cls(raw["type"], raw["object"])

    @property
    def expired(self) -> bool:
        """The server no longer has the resourceVersion asked from: list again."""
        return self.type == "ERROR" and self.object.get("code") == GONE

    def error(self) -> str:
        """An ERROR event's Status, told as the server said it."""
        return f"{self.object.get('code')} {self.object.get('reason', '')}: {self.object.get('message', '')}"
