"""A small sim worker profile that tests saturate on purpose (overload, cache pressure): one
sm100 GPU that runs 4 sequences at 60 tokens/s each and prefills 20,000 tokens/s."""

from __future__ import annotations


def small_sm100(memory_capacity_blocks: int | None = None, scheduling_policy: str = "fcfs") -> str:
    """The text of a profiles file (`--profiles`, ClusterConfig.profiles) whose `[sm100]` is that
    worker; `memory_capacity_blocks` bounds its KV cache, else sm100's own size holds;
    `scheduling_policy`: "priority" preempts (workers/sim/core.py)."""
    memory = "" if memory_capacity_blocks is None else f"memory_capacity_blocks = {memory_capacity_blocks}\n"
    return f"""
[sm100]
hardware = "sm100"
kv_format = "v4.1-flash/sm100-fp8"
prefill_points = [[4096, 20000]]
decode_points = [[1, 60], [8, 60]]
gpus_per_instance = 1
dp_ranks = 1
max_num_seqs = 4
max_num_batched_tokens = 4096
{memory}nextn = 0
scheduling_policy = "{scheduling_policy}"
"""
