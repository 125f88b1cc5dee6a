"""How every service proves itself to NATS and Redis, read once with the rest of its config.

Secrets never come by flag (``ps`` shows a process's argv to every user): a password comes from the
environment or from a file named by a flag or variable. Everything else may be a flag too.

    NATS_USER / --nats-user                 the NATS user (``llmserve up``: the service's kind)
    NATS_PASSWORD                           its password, or
    NATS_PASSWORD_FILE / --nats-password-file   a file holding it
    NATS_TLS_CA, NATS_TLS_CERT, NATS_TLS_KEY    TLS: the server's CA, a client certificate and key
    (and the --nats-tls-* flags)            (use a tls:// URL)
    REDIS_USERNAME, REDIS_PASSWORD, REDIS_PASSWORD_FILE, REDIS_TLS_CA, REDIS_TLS_CERT,
    REDIS_TLS_KEY (and the --redis-* flags) the same for Redis (use a rediss:// URL for TLS);
                                            a password in REDIS_URL works too
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from services.runtime import env_str, read_secret_file, refuse_secret_flag
from shared.wire.bus_auth import BusAuth

__all__ = [
    "ENV_NATS_PASSWORD",
    "ENV_NATS_USER",
    "ENV_REDIS_PASSWORD",
    "ENV_REDIS_USERNAME",
    "NATS_ENV",
    "REDIS_ENV",
    "RedisAuth",
    "add_nats_auth_arguments",
    "add_redis_auth_arguments",
    "nats_auth_from_args",
    "redis_auth_from_args",
]

ENV_NATS_USER = "NATS_USER"
ENV_NATS_PASSWORD = "NATS_PASSWORD"
ENV_REDIS_USERNAME = "REDIS_USERNAME"
ENV_REDIS_PASSWORD = "REDIS_PASSWORD"
# Every variable that says how to reach one server (the URL aside): a launcher that starts the
# server itself gives its services its own values instead of inherited ones.
NATS_ENV = (
    ENV_NATS_USER,
    ENV_NATS_PASSWORD,
    "NATS_PASSWORD_FILE",
    "NATS_TLS_CA",
    "NATS_TLS_CERT",
    "NATS_TLS_KEY",
)
REDIS_ENV = (
    ENV_REDIS_USERNAME,
    ENV_REDIS_PASSWORD,
    "REDIS_PASSWORD_FILE",
    "REDIS_TLS_CA",
    "REDIS_TLS_CERT",
    "REDIS_TLS_KEY",
)


@dataclass(frozen=True)
class RedisAuth:
    username: str | None = None  # None with a password: Redis's default user (requirepass)
    password: str | None = field(default=None, repr=False)  # never printed
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None

    def __post_init__(self) -> None:
        if self.username is not None and not self.password:
            raise ValueError(f"Redis user {self.username!r} has no password (REDIS_PASSWORD)")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("a Redis client certificate needs both its cert and its key file")

    @property
    def uses_tls_files(self) -> bool:
        return self.tls_ca_file is not None or self.tls_cert_file is not None

    def client_options(self) -> dict[str, Any]:
        """Keywords for redis-py's ``from_url`` (the TLS ones only for a rediss:// URL)."""
        options: dict[str, Any] = {}
        if self.password is not None:
            options.update(username=self.username, password=self.password)
        if self.tls_ca_file is not None:
            options["ssl_ca_certs"] = self.tls_ca_file
        if self.tls_cert_file is not None:
            options.update(ssl_certfile=self.tls_cert_file, ssl_keyfile=self.tls_key_file)
        return options

    def describe(self) -> str:
        return f"user {self.username or 'default'!r}" if self.password else "no password"


def _add_auth_arguments(p: argparse.ArgumentParser, server: str, user_flag: str) -> None:
    prefix, env = server.lower(), server.upper()
    user_env = ENV_NATS_USER if server == "NATS" else ENV_REDIS_USERNAME
    p.add_argument(
        f"--{prefix}-{user_flag}",
        default=env_str(user_env, None),
        help=f"the {server} user to connect as [env {user_env}]",
    )
    refuse_secret_flag(
        p, f"--{prefix}-password", f"set {env}_PASSWORD or use --{prefix}-password-file"
    )
    p.add_argument(
        f"--{prefix}-password-file",
        default=env_str(f"{env}_PASSWORD_FILE", None),
        metavar="PATH",
        help=f"a file holding the {server} password (the password itself only by env "
        f"{env}_PASSWORD, never a flag) [env {env}_PASSWORD_FILE]",
    )
    for what, help in (
        ("ca", "the CA that signed the server's TLS certificate (default: the system's)"),
        ("cert", "a client TLS certificate, for a server that verifies its clients"),
        ("key", "the client certificate's key"),
    ):
        p.add_argument(
            f"--{prefix}-tls-{what}",
            default=env_str(f"{env}_TLS_{what.upper()}", None),
            metavar="PATH",
            help=f"{help} [env {env}_TLS_{what.upper()}]",
        )


def _password(file: str | None, env: str, what: str) -> str | None:
    return read_secret_file(file, what) if file is not None else env_str(env, None)


def add_nats_auth_arguments(p: argparse.ArgumentParser) -> None:
    _add_auth_arguments(p, "NATS", "user")


def nats_auth_from_args(a: argparse.Namespace) -> BusAuth:
    """ValueError for an unreadable password file or an incomplete pair."""
    return BusAuth(
        user=a.nats_user,
        password=_password(a.nats_password_file, ENV_NATS_PASSWORD, "NATS password"),
        tls_ca_file=a.nats_tls_ca,
        tls_cert_file=a.nats_tls_cert,
        tls_key_file=a.nats_tls_key,
    )


def add_redis_auth_arguments(p: argparse.ArgumentParser) -> None:
    _add_auth_arguments(p, "Redis", "username")


def redis_auth_from_args(a: argparse.Namespace) -> RedisAuth:
    return RedisAuth(
        username=a.redis_username,
        password=_password(a.redis_password_file, ENV_REDIS_PASSWORD, "Redis password"),
        tls_ca_file=a.redis_tls_ca,
        tls_cert_file=a.redis_tls_cert,
        tls_key_file=a.redis_tls_key,
    )
