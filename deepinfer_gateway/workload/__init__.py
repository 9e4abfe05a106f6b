"""Workloads and their measurements, without a network: what to send and what came back.

- `types`: `TraceRequest` / `Trace` (a workload), `RequestRecord` (what one request
  measured; `results.jsonl` is one per line, `write_records` / `read_records`).
- `traces`: `load_trace(spec)` for files, published traces (`trace_sources`, fetched once
  and verified) and the built-in `synthetic` workloads.
- `synthesis`: trace block ids -> prompt text whose token blocks follow the ids.
- `oracle`: the infinite-global-cache hit rate of a hash-id trace.
- `summary`: records -> `summary.json` (pure).

Shared by the load generator (`loadgen/`, which sends these workloads to a live server)
and the offline simulator (`simulate/`, which produces the same records in virtual time).
Imports no other folder but `recipe_bridge` (the tokenizer, the trace cache directory).
"""
