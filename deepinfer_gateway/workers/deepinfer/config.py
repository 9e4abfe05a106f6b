"""Configuration of one DeepInfer worker (one `LLMEngine` = one DP rank process)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deepinfer_gateway.core.protocol import DEFAULT_MODEL, Hardware, Role

# Same strings as the sim's profiles.toml: KV written on one format is useless on the other.
DEFAULT_KV_FORMAT = {Hardware.SM100: "v4.1-flash/sm100-fp8", Hardware.ASCEND950: "v4.1-flash/ascend950-int8"}


class DeepInferConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1, description="checkpoint directory (EngineArgs.model)")
    role: Role = Role.UNIFIED
    hardware: Hardware = Hardware.SM100
    worker_id: str = Field("deepinfer-0", min_length=1)
    served_model: str = Field(DEFAULT_MODEL, description="model name in kv_salt; must equal the gateway's")
    kv_format: str = Field("", description="empty: the hardware's default (DEFAULT_KV_FORMAT)")
    tokenizer: str | None = None
    max_model_len: int | None = Field(None, ge=1)
    data_parallel_size: int = Field(0, ge=0, description="0: DeepInfer derives max(1, EP // CP)")
    context_parallel_size: int = Field(1, ge=1)
    expert_parallel_size: int = Field(1, ge=1)
    engine_rank: int = Field(0, ge=0)
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=1)
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    chunked_prefill: bool = False
    engine_args: dict[str, Any] = Field(default_factory=dict, description="more EngineArgs fields, verbatim")
    kv_store_dir: str | None = Field(None, description="FileKvStore root shared by prefill and decode workers")
    drain_timeout_s: float = Field(10.0, ge=0.0, description="stop(): how long in-flight requests may finish")
    dp_poll_s: float = Field(0.002, gt=0.0, description="idle poll when DP > 1 (has_unfinished is collective)")
    kv_events_retain: int = Field(100_000, ge=1)

    @model_validator(mode="after")
    def _known_engine_args(self) -> DeepInferConfig:
        clash = set(self.engine_args) & {"model", "tokenizer", "engine_type"}
        if clash:
            raise ValueError(f"engine_args: {sorted(clash)} are set by the wrapper (use the named fields)")
        return self

    @property
    def resolved_kv_format(self) -> str:
        return self.kv_format or DEFAULT_KV_FORMAT[self.hardware]

    @property
    def dp_size(self) -> int:
        """As deepinfer's ParallelConfig: 0 means max(1, EP // CP)."""
        return self.data_parallel_size or max(1, self.expert_parallel_size // self.context_parallel_size)

    def engine_args_kwargs(self, engine_type: Any) -> dict[str, Any]:
        return {
            "model": self.model,
            "tokenizer": self.tokenizer,
            "served_model_name": self.served_model,
            "max_model_len": self.max_model_len,
            "data_parallel_size": self.data_parallel_size,
            "context_parallel_size": self.context_parallel_size,
            "expert_parallel_size": self.expert_parallel_size,
            "engine_rank": self.engine_rank,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "chunked_prefill": self.chunked_prefill,
            "engine_type": engine_type,
            **self.engine_args,
        }
