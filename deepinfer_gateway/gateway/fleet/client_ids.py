"""The worker as clients see it (the `x-dgw-worker` response header): its configured `id`,
or, when it has none (its id is then the URL's host:port), a short digest of that id.
Clients must not learn the workers' addresses; an operator maps a digest back with
`GET /admin/workers` (`client_id`) and finds the address in the logs."""

from __future__ import annotations

import hashlib

from deepinfer_gateway.config import WorkerSpec


def client_worker_id(spec: WorkerSpec) -> str:
    return spec.id or digest_of(spec.worker_id)


def digest_of(worker_id: str) -> str:
    return "w-" + hashlib.sha256(worker_id.encode()).hexdigest()[:12]
