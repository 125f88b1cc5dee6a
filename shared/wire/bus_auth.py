"""How a process proves itself to NATS: a user and password, and TLS for a server on another host.

Filled once by each service's config (``services.connections``: the environment, or a file for the
password, never argv) and handed to ``Bus.connect``. ``llmserve up`` gives each kind of service its
own user (``shared.wire.permissions``); with no user the connection is anonymous, which only an open
server (the service tests') accepts.
"""

from __future__ import annotations

import ssl
import urllib.parse
from dataclasses import dataclass, field

from shared.wire.permissions import inbox_prefix

__all__ = ["AccessRefused", "BusAuth", "redact_url"]


class AccessRefused(Exception):
    """A server refused who we are (NATS, Redis): a configuration error that waiting will not
    fix. A service stops at start with its message alone (``services.runtime.run_service``), which
    names the server and the user, never the password."""


@dataclass(frozen=True)
class BusAuth:
    user: str | None = None
    password: str | None = field(default=None, repr=False)  # never printed
    # TLS (a tls:// URL, or a server that requires TLS): the CA that signed the server's
    # certificate (None: the system's CAs), and a client certificate for a server that verifies
    # its clients.
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None

    def __post_init__(self) -> None:
        if self.user is not None:
            inbox_prefix(self.user)  # ValueError unless one subject token
        if self.password is not None and self.user is None:
            raise ValueError("a NATS password needs its user (NATS_USER)")
        if self.user is not None and not self.password:
            raise ValueError(f"NATS user {self.user!r} has no password (NATS_PASSWORD)")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("a NATS client certificate needs both its cert and its key file")

    @property
    def inbox_prefix(self) -> str | None:
        """Replies to this user's requests come under ``_INBOX.<user>``, the one inbox prefix its
        permissions let it subscribe to (None: nats-py's default, for an anonymous client)."""
        return None if self.user is None else inbox_prefix(self.user)

    @property
    def uses_tls_files(self) -> bool:
        return self.tls_ca_file is not None or self.tls_cert_file is not None

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context for these files (None: none given; nats-py then uses the system's CAs
        for a tls:// URL). The server's name is checked against its certificate."""
        if not self.uses_tls_files:
            return None
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.tls_ca_file)
        if self.tls_cert_file is not None:
            context.load_cert_chain(self.tls_cert_file, self.tls_key_file)
        return context

    def describe(self) -> str:
        """For messages: who connects, never the password."""
        return f"user {self.user!r}" if self.user is not None else "no user (anonymous)"


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***``, for logs and errors (a URL given by the
    environment may carry credentials)."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{parts.username or ''}:***@{host}"
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))
