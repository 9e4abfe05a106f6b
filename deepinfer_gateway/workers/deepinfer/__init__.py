"""The `deepinfer` engine: an online-serving wrapper around DeepInfer's `LLMEngine`.

Importing this package never imports `deepinfer` (Python 3.12 + CUDA 13 / CANN 9.2
only); constructing `DeepInferEngine` does, and says what to install when it cannot.
Layout: api (lazy imports), config, engine (asyncio side), stepper (the engine thread),
step_messages (commands, event batches and load between the two), handoff (PD KV hand-off
through the store), mapping (sampling/finish translation), transfer (PD hooks + KV
adapter), kvstore (store tier seam), events (KV event log). See docs/deepinfer.md.
"""

from deepinfer_gateway.workers.deepinfer.api import INSTALL_HINT, DeepInferApi, DeepInferNotInstalled, load_api
from deepinfer_gateway.workers.deepinfer.config import DeepInferConfig
from deepinfer_gateway.workers.deepinfer.engine import DeepInferEngine, build_deepinfer_engine
from deepinfer_gateway.workers.deepinfer.kvstore import FileKvStore, KvStore, MemoryKvStore
from deepinfer_gateway.workers.deepinfer.transfer import KvTransfer, UnavailableKvTransfer

__all__ = [
    "INSTALL_HINT",
    "DeepInferApi",
    "DeepInferConfig",
    "DeepInferEngine",
    "DeepInferNotInstalled",
    "FileKvStore",
    "KvStore",
    "KvTransfer",
    "MemoryKvStore",
    "UnavailableKvTransfer",
    "build_deepinfer_engine",
    "load_api",
]
