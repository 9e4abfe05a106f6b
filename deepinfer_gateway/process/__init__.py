"""How the processes start and run: the `deepinfer-gateway` entry point and its commands, one
gateway process, several under a supervisor, the init a container lacks as PID 1, and the bind
check before a gateway listens. Stands on every folder; nothing below imports it."""
