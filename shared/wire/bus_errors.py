"""The bus's errors: what ``Bus`` and ``Subscription`` raise in place of nats-py's own."""

from __future__ import annotations

from shared.wire.bus_auth import AccessRefused

__all__ = ["BusAuthError", "BusError", "BusInterrupted", "BusNoResponders", "BusTimeout"]


class BusError(Exception):
    """A bus operation failed (connection lost, closed, payload too large, ...)."""


class BusAuthError(BusError, AccessRefused):
    """The server refused who we are: a wrong user or password, or (TLS) a server certificate
    that does not verify. Waiting will not help: a service fails at start with this message."""


class BusTimeout(BusError, TimeoutError):
    """No reply to a request within its timeout."""


class BusInterrupted(BusError):
    """``Subscription.interrupt()`` was called: the subscriber's owner stops waiting (shutdown)."""


class BusNoResponders(BusTimeout):
    """No subscriber at all for a request's subject; fails fast instead of waiting out the timeout.
    A subclass of BusTimeout so callers that only care about "no answer" catch one exception."""
