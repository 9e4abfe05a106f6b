"""Per-tier cache figures from a DeepInfer Gateway's Prometheus endpoint.

Only the gateway knows which tier (worker memory or the shared KV store) served the
cached tokens; clients see only the total. `scrape` reads the counters
`dgw_cached_prompt_tokens_total{tier}` and `dgw_prompt_tokens_total` from
`<root>/metrics`; the bench takes the delta over its run. Any other server (no such
endpoint or no such counters) yields None, and the summary's tier figures are null.
The delta includes other clients' traffic during the run.
"""

from __future__ import annotations

import re
import urllib.error
import urllib.request

from deepinfer_gateway.workload.summary import TierTokens

_SAMPLE = re.compile(r'^(dgw_cached_prompt_tokens_total|dgw_prompt_tokens_total)(\{[^}]*\})?\s+(\S+)', re.MULTILINE)
_TIER = re.compile(r'tier="([^"]*)"')


def parse(text: str) -> TierTokens | None:
    tiers: dict[str, float] = {}
    prompt: float | None = None
    for name, labels, value in _SAMPLE.findall(text):
        if name == "dgw_prompt_tokens_total":
            prompt = (prompt or 0.0) + float(value)
        else:
            m = _TIER.search(labels or "")
            if m:
                tiers[m.group(1)] = tiers.get(m.group(1), 0.0) + float(value)
    if prompt is None:
        return None
    return TierTokens(memory=tiers.get("memory", 0.0), store=tiers.get("store", 0.0), prompt=prompt)


def scrape(root_url: str, timeout_s: float = 5.0) -> TierTokens | None:
    try:
        with urllib.request.urlopen(root_url.rstrip("/") + "/metrics", timeout=timeout_s) as response:
            return parse(response.read().decode("utf-8", "replace"))
    except (urllib.error.URLError, OSError, ValueError):
        return None


def delta(before: TierTokens | None, after: TierTokens | None) -> TierTokens | None:
    if before is None or after is None:
        return None
    return TierTokens(memory=after.memory - before.memory, store=after.store - before.store,
                      prompt=after.prompt - before.prompt)
