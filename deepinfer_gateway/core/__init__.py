"""The shared kernel: the worker protocol, the error tree, header names, the model catalog,
tracing, the outage bookkeeping, the worker token and the session identity. Every folder
imports it; it imports no folder (config/ aside)."""
