"""A stack's credentials: one NATS user per service kind with the permissions of
``shared.wire.permissions``, an admin NATS user for operators and tests, and two Redis users: the
prefix index's and the gateway's (per-key limits), each on its own key prefix alone.
``llmserve up`` generates a fresh set per stack; ``llmserve credentials DIR`` writes a set to files
for servers run by someone else (``write``, ``load``)::

    DIR/nats-users.conf     the nats-server ``authorization`` block: ``include`` it in its config
    DIR/redis-users.acl     the Redis ACL: ``aclfile`` it in redis.conf
    DIR/<kind>.env          each kind's variables (compose's ``env_file``, systemd's
                            ``EnvironmentFile``); admin.env for operators

Where each secret lives (never on a command line: ``ps`` shows every process's argv to every user):

- the launcher's memory (``Stack.credentials``);
- the servers' config files, mode 0600 in their private (0700) temp dirs, removed with them;
- each service's environment, its own kind's credentials alone: ``NATS_USER`` / ``NATS_PASSWORD``,
  and for the prefix index and the gateway ``REDIS_USERNAME`` / ``REDIS_PASSWORD`` (a process's
  environment is readable by its own user and root only).
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field

from services.connections import (
    ENV_NATS_PASSWORD,
    ENV_NATS_USER,
    ENV_REDIS_PASSWORD,
    ENV_REDIS_USERNAME,
)
from services.gateway.limiter import DEFAULT_KEY_PREFIX as DEFAULT_LIMITS_KEY_PREFIX
from services.prefix_index.config import DEFAULT_KEY_PREFIX
from services.prefix_index.logic import hash_tag_prefix
from shared.wire.bus_auth import BusAuth
from shared.wire.permissions import ADMIN_USER, PERMISSIONS, SERVICE_KINDS, Permissions

__all__ = [
    "NATS_CONFIG_FILE",
    "REDIS_ACL_FILE",
    "REDIS_GATEWAY_USER",
    "REDIS_INDEX_USER",
    "StackCredentials",
]

REDIS_INDEX_USER = "prefix_index"
# The gateway keeps per-key limits (services/gateway/limiter.py) under its own prefix, with the
# few commands its scripts run: it can neither read nor touch the index.
REDIS_GATEWAY_USER = "gateway"
_GATEWAY_COMMANDS = (
    "evalsha script|load ping time hmget hset pexpire zadd zremrangebyscore zcard zrange zscore "
    "zrem"
)


def _password() -> str:
    # 256 bits; URL-safe characters, so it needs no quoting in a config file or a URL.
    return secrets.token_urlsafe(32)


@dataclass(frozen=True)
class StackCredentials:
    nats_passwords: Mapping[str, str] = field(repr=False)  # user -> password
    redis_password: str = field(repr=False)  # REDIS_INDEX_USER's
    redis_key_prefix: str = DEFAULT_KEY_PREFIX  # the only keys that user may touch
    # REDIS_GATEWAY_USER's, on the gateway's limits prefix alone.
    redis_gateway_password: str = field(default_factory=lambda: _password(), repr=False)
    redis_gateway_key_prefix: str = DEFAULT_LIMITS_KEY_PREFIX

    def __post_init__(self) -> None:
        missing = set(PERMISSIONS) - set(self.nats_passwords)
        if missing:
            raise ValueError(f"no NATS password for {sorted(missing)}")
        if (
            not self.redis_password
            or not self.redis_gateway_password
            or not all(self.nats_passwords.values())
        ):
            raise ValueError("a password must not be empty")
        hash_tag_prefix(self.redis_key_prefix)

    @classmethod
    def generate(cls, redis_key_prefix: str = DEFAULT_KEY_PREFIX) -> StackCredentials:
        return cls(
            nats_passwords={user: _password() for user in PERMISSIONS},
            redis_password=_password(),
            redis_key_prefix=redis_key_prefix,
        )

    def nats_auth(self, user: str) -> BusAuth:
        return BusAuth(user=user, password=self.nats_passwords[user])

    @property
    def admin(self) -> BusAuth:
        """Every subject, both ways: for operators and tests that watch or drive the stack
        (``Bus.connect(stack.nats_url, name, auth=stack.credentials.admin)``). No service gets
        it."""
        return self.nats_auth(ADMIN_USER)

    def write(self, directory: str) -> list[str]:
        """Write the files above into ``directory`` (created 0700 if missing), each 0600; an
        existing file is never overwritten (ValueError). Returns their paths."""
        os.makedirs(directory, mode=0o700, exist_ok=True)
        files = {
            NATS_CONFIG_FILE: self.nats_authorization(),
            REDIS_ACL_FILE: self.redis_acl(),
            **{
                f"{kind}.env": _env_file({**self.nats_env(kind), **self.redis_env(kind)})
                for kind in SERVICE_KINDS
            },
            f"{ADMIN_USER}.env": _env_file(
                {ENV_NATS_USER: ADMIN_USER, ENV_NATS_PASSWORD: self.nats_passwords[ADMIN_USER]}
            ),
        }
        paths = []
        for name, text in files.items():
            path = os.path.join(directory, name)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                raise ValueError(f"{path} exists: credentials are never overwritten") from None
            with os.fdopen(fd, "w") as f:
                f.write(text + "\n")
            paths.append(path)
        return paths

    @classmethod
    def load(cls, directory: str) -> StackCredentials:
        """The set ``write`` wrote (its .env files); ValueError naming what is missing."""
        passwords: dict[str, str] = {}
        redis_passwords: dict[str, str] = {}
        for user in PERMISSIONS:
            env = _read_env_file(os.path.join(directory, f"{user}.env"))
            if env.get(ENV_NATS_USER) != user or not env.get(ENV_NATS_PASSWORD):
                raise ValueError(f"{directory}/{user}.env lacks {user}'s NATS_USER/NATS_PASSWORD")
            passwords[user] = env[ENV_NATS_PASSWORD]
            if user in (REDIS_INDEX_USER, REDIS_GATEWAY_USER):
                if not env.get(ENV_REDIS_PASSWORD):
                    raise ValueError(f"{directory}/{user}.env lacks REDIS_PASSWORD")
                redis_passwords[user] = env[ENV_REDIS_PASSWORD]
        return cls(
            nats_passwords=passwords,
            redis_password=redis_passwords[REDIS_INDEX_USER],
            redis_gateway_password=redis_passwords[REDIS_GATEWAY_USER],
        )

    def nats_env(self, kind: str) -> dict[str, str]:
        """What a service of ``kind`` finds in its environment for NATS: its own user."""
        if kind not in SERVICE_KINDS:
            raise ValueError(f"unknown service kind {kind!r}; one of {SERVICE_KINDS}")
        return {ENV_NATS_USER: kind, ENV_NATS_PASSWORD: self.nats_passwords[kind]}

    def redis_env(self, kind: str) -> dict[str, str]:
        """For Redis: its own user for the prefix index and the gateway, nothing for the others."""
        if kind == REDIS_INDEX_USER:
            return {ENV_REDIS_USERNAME: REDIS_INDEX_USER, ENV_REDIS_PASSWORD: self.redis_password}
        if kind == REDIS_GATEWAY_USER:
            return {
                ENV_REDIS_USERNAME: REDIS_GATEWAY_USER,
                ENV_REDIS_PASSWORD: self.redis_gateway_password,
            }
        return {}

    def secrets(self) -> list[str]:
        """Every password (for tests that check none leaks)."""
        return [*self.nats_passwords.values(), self.redis_password, self.redis_gateway_password]

    def nats_authorization(self) -> str:
        """The nats-server config block: every user with its password and permissions; anyone
        else (anonymous included) is refused."""
        users = ",\n".join(
            f"    {{user: {_quote(user)}, password: {_quote(password)}, "
            f"permissions: {_nats_permissions(PERMISSIONS[user])}}}"
            for user, password in self.nats_passwords.items()
        )
        return f"authorization {{\n  users = [\n{users}\n  ]\n}}"

    def redis_acl(self) -> str:
        """Redis 6 ACL directives: the default (unauthenticated) user off, so any other client gets
        NOAUTH; the prefix index's user on its own keys, no pub/sub, no dangerous command but INFO
        (it reads the server's version); the gateway's on its limits' keys, with only the commands
        its scripts run."""
        keys = f"~{hash_tag_prefix(self.redis_key_prefix)}:*"
        gateway_commands = " ".join(f"+{c}" for c in _GATEWAY_COMMANDS.split())
        return (
            "user default off\n"
            f"user {REDIS_INDEX_USER} on >{self.redis_password} {keys} resetchannels "
            "+@all -@dangerous +info\n"
            f"user {REDIS_GATEWAY_USER} on >{self.redis_gateway_password} "
            f"~{self.redis_gateway_key_prefix}:* resetchannels -@all {gateway_commands}"
        )


NATS_CONFIG_FILE = "nats-users.conf"
REDIS_ACL_FILE = "redis-users.acl"


def _env_file(env: dict[str, str]) -> str:
    # Values are URL-safe (no quoting needed by compose, systemd or a shell's `set -a; .`).
    return "\n".join(f"{k}={v}" for k, v in env.items())


def _read_env_file(path: str) -> dict[str, str]:
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    pairs = (line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))
    return {k.strip(): v.strip() for k, v in pairs}


def _quote(text: str) -> str:
    # A JSON string is a valid nats-server config string, and quoting keeps '$' literal (an
    # unquoted $NAME would be a variable).
    return json.dumps(text)


def _nats_permissions(p: Permissions) -> str:
    def allow(subjects: tuple[str, ...]) -> str:
        return f"{{allow: [{', '.join(_quote(s) for s in subjects)}]}}"

    responses = ", allow_responses: true" if p.allow_responses else ""
    return f"{{publish: {allow(p.publish)}, subscribe: {allow(p.subscribe)}{responses}}}"
