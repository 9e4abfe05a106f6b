"""The Redis ACL users the deploy files ship (deploy/k8s/redis.yaml's args, docker-compose.yml's
command), read from those files so the tests start Redis with exactly them."""

from __future__ import annotations

import shlex
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def k8s_redis_container() -> dict[str, object]:
    docs = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "redis.yaml").read_text()) if d]
    (sts,) = [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "redis"]
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    return container


def k8s_redis_args() -> list[str]:
    """redis-server's options after its config file."""
    args = k8s_redis_container()["args"]
    assert isinstance(args, list) and args[:2] == ["redis-server", "/etc/redis/redis.conf"], args
    return [str(a) for a in args[2:]]


def compose_redis_args() -> list[str]:
    """The compose Redis's options after its config file, as its `sh -c` script passes them."""
    command = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]["redis"]["command"]
    assert command[:2] == ["sh", "-c"], command
    words = shlex.split(command[2])
    assert words[:4] == ["exec", "docker-entrypoint.sh", "redis-server", "/usr/local/etc/redis/redis.conf"], words
    return words[4:]


def acl_users(args: list[str]) -> dict[str, list[str]]:
    """{user: its ACL rules} of the `--user` options in `args` (nothing else may be there)."""
    users: dict[str, list[str]] = {}
    rules: list[str] | None = None
    for arg in args:
        if arg.startswith("--"):
            assert arg == "--user", f"an option other than --user: {arg}"
            rules = None
        elif rules is None:
            assert arg not in users, f"user {arg} defined twice"
            rules = users[arg] = []
        else:
            rules.append(arg)
    return users


def without_passwords(users: dict[str, list[str]]) -> dict[str, list[str]]:
    """The rules with each `>password` (a placeholder in the deploy files) as `>`."""
    return {user: [">" if r.startswith(">") else r for r in rules] for user, rules in users.items()}


def server_args(users: dict[str, list[str]], passwords: dict[str, str]) -> list[str]:
    """redis-server options defining `users`, each `>placeholder` replaced by `passwords[user]`."""
    out: list[str] = []
    for user, rules in users.items():
        out += ["--user", user, *(f">{passwords[user]}" if r.startswith(">") else r for r in rules)]
    return out
