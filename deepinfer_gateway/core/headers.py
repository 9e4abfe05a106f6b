"""The gateway's own HTTP response header names, spelled once (a leaf: imports nothing).

`x-request-id` is also the worker protocol's request header (protocol.REQUEST_ID_HEADER,
the same name): the gateway echoes a client's, or answers with the one it made.
"""

REQUEST_ID = "x-request-id"
WORKER = "x-dgw-worker"  # the worker of the request's first leg (a PD request: its prefill worker)
PROCESS = "x-dgw-process"  # on every response of a supervised process: its pid
SESSION = "x-session-id"  # request header: the routing session when the body names no `user`
CORRELATION = "x-correlation-id"  # the same, as AIPerf and Dynamo's clients pin sessions
SESSIONS = (SESSION, CORRELATION)  # read in this order
SERVICE_TIER = "x-dgw-service-tier"  # request header from a trusted proxy: the tier (flow_control.tier_header)
SLO_TTFT_MS = "x-slo-ttft-ms"  # request header: the request's TTFT target (Gateway API Inference Extension's)
