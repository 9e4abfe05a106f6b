"""The load generator behind `deepinfer-gateway bench`: replays a workload against a live
OpenAI/Anthropic-compatible server through the real SDKs and reports what it measured.

- `client`: one SDK call -> one `RequestRecord`; `replay`: open or closed loop on the
  trace clock; `run`: one run (trace -> replay -> `results.jsonl`, `summary.json`, plots);
  `sweep`: several runs (rate, concurrency, routing policy); `report`: runs side by side;
  `plots`: the PNG charts; `gateway_metrics`: per-tier cache counters scraped from a
  DeepInfer Gateway; `command`: the `bench` CLI arguments and dispatch.

Workloads, records and summaries come from `workload/`. The benchmark scripts that drive
this package against clusters they start themselves live in the repository's `bench/`.
"""
