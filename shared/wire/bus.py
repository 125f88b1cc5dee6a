"""A thin async message bus over nats-py: the only module that touches the NATS client directly.

Every service talks through ``Bus``: publish, request/reply with a clear ``BusTimeout``, callback
subscriptions whose handler exceptions are logged (never killing the subscription) and iterator
subscriptions for per-request streams. Subjects come from ``shared.wire.subjects``; payloads are
bytes (encode with ``shared.wire.messages`` codecs).

Ordering: NATS delivers the messages of one publisher connection to one subscription in publish
order. A callback subscription runs its handler for one message at a time, so per-subscription order
is kept (the gateway's token stream depends on it). A handler that must not block the next message
should hand work to its own task.

Subscribe-before-publish: a SUB and a later PUB on the *same* connection reach the server in order,
so the gateway can subscribe to ``stream(rid)`` and publish the request without a flush. Across
connections (tests, other processes) call ``flush()`` after subscribing to be sure the server knows.

Losing the server: the connection reconnects by itself, forever, with a bounded backoff
(``reconnect_delay_s``: 0 s, then 0.1 s doubling up to 1 s between attempts), replaying its
subscriptions; a dead server is logged once per outage (and every ``_STILL_DOWN_LOG_S``), not at
every attempt. Core NATS keeps nothing for a client that is away: what was published to it meanwhile
is gone, and what it publishes meanwhile waits in a bounded buffer (over it: ``BusError``). So a
service that holds requests registers ``on_connection_lost`` and ends them: after a reconnect no
one can tell which of their messages were lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import nats
import nats.errors
import nats.js.api
import nats.js.errors
from nats.aio.client import Client
from nats.aio.client import Server as _NatsServer
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription as _NatsSubscription

from shared.wire.bus_auth import BusAuth, redact_url
from shared.wire.bus_errors import (
    BusAuthError,
    BusError,
    BusInterrupted,
    BusNoResponders,
    BusTimeout,
)
from shared.wire.bus_subscription import PullConsumer, Subscription
from shared.wire.permissions import inbox_prefix

__all__ = [
    "Bus",
    "BusAuth",
    "BusAuthError",
    "BusError",
    "BusInterrupted",
    "BusNoResponders",
    "BusTimeout",
    "Handler",
    "Msg",
    "PullConsumer",
    "Subscription",
    "reconnect_delay_s",
]

log = logging.getLogger("llmserve.bus")

Handler = Callable[[Msg], Awaitable[None]]

# A subscription buffers at most this many unprocessed messages (nats-py drops beyond it and reports
# a slow consumer). Generous: a stream subscription may fall behind a fast executor for a while.
PENDING_MSGS_LIMIT = 1 << 16
PENDING_BYTES_LIMIT = 256 * 1024 * 1024

# Reconnect backoff: the first attempt at once (a restarted server is usually back within a
# second), then from _RECONNECT_FIRST_WAIT_S doubling up to _RECONNECT_MAX_WAIT_S, so a server that
# comes back is found within that bound and a dead one costs a few attempts a second.
_RECONNECT_FIRST_WAIT_S = 0.1
_RECONNECT_MAX_WAIT_S = 1.0
_STILL_DOWN_LOG_S = 10.0  # while disconnected, a reminder this often (not one line per attempt)

# Errors that mean "the connection cannot carry this now"; all become BusError.
_CONNECTION_ERRORS = (
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionDrainingError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.OutboundBufferLimitError,
)


def reconnect_delay_s(num_failed_attempts: int) -> float:
    """Seconds to wait before the next reconnect attempt, after ``num_failed_attempts`` failed ones
    since the connection was lost: 0, 0.1, 0.2, 0.4, 0.8, then 1.0 for ever."""
    if num_failed_attempts <= 0:
        return 0.0
    return min(_RECONNECT_MAX_WAIT_S, _RECONNECT_FIRST_WAIT_S * 2 ** (num_failed_attempts - 1))


def _is_refusal(e: Exception) -> bool:
    """A first-connection error that retrying cannot cure: the server refused our user, or TLS
    failed over a certificate (theirs does not verify, ours is missing or not trusted)."""
    if isinstance(e, ssl.SSLError):
        reason = getattr(e, "reason", None) or ""
        return (
            isinstance(e, ssl.SSLCertVerificationError)
            or "CERTIFICATE" in reason
            or ("UNKNOWN_CA" in reason)
        )
    return isinstance(e, nats.errors.AuthorizationError) or (
        "authorization violation" in str(e).lower()
    )


def _describe(auth: BusAuth, user: str | None) -> str:
    return auth.describe() if auth.user is not None or user is None else f"user {user!r} (URL)"


def _why(e: Exception) -> str:
    if isinstance(e, ssl.SSLCertVerificationError):
        return f"the server's TLS certificate does not verify ({e.verify_message}; NATS_TLS_CA)"
    if isinstance(e, ssl.SSLError):
        return (
            f"the server did not accept our TLS client certificate ({e.reason}; NATS_TLS_CERT, "
            "NATS_TLS_KEY)"
        )
    return "authorization violation (a wrong or missing user or password: NATS_USER, NATS_PASSWORD)"


class Bus:
    """One named NATS connection. Create with ``await Bus.connect(url, name)``."""

    def __init__(self, nc: Client, name: str) -> None:
        self._nc = nc
        self.name = name
        self._closing = False  # a disconnect we asked for is not worth a warning
        self._lost_listeners: list[Callable[[], None]] = []
        self._back_listeners: list[Callable[[], None]] = []
        self.disconnected_since: float | None = None  # monotonic; None while connected
        self.num_disconnects = 0

    def on_connection_lost(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` (on the loop, synchronously) each time the connection is lost,
        before reconnecting starts. Not called for our own close or drain."""
        self._lost_listeners.append(listener)

    def on_reconnected(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` each time the connection is back (subscriptions replayed)."""
        self._back_listeners.append(listener)

    def _lost(self) -> None:
        if self._closing:
            return
        self.disconnected_since = time.monotonic()
        self.num_disconnects += 1
        log.warning("[%s] disconnected from nats; reconnecting", self.name)
        _notify(self.name, self._lost_listeners)

    def _back(self) -> None:
        since, self.disconnected_since = self.disconnected_since, None
        away = f" after {time.monotonic() - since:.1f}s" if since is not None else ""
        log.info("[%s] reconnected to nats%s", self.name, away)
        _notify(self.name, self._back_listeners)

    @classmethod
    async def connect(
        cls,
        url: str,
        name: str,
        *,
        auth: BusAuth | None = None,
        connect_timeout_s: float = 30.0,
        reconnect_wait_s: float = 0.5,
        pending_bytes: int = 8 * 1024 * 1024,
    ) -> Bus:
        """Connect as ``auth``'s user (anonymous without one), retrying the *first* connection for
        up to ``connect_timeout_s`` (a service may start before the server is up; every
        ``reconnect_wait_s``); after that, reconnect forever with ``reconnect_delay_s``'s backoff.
        A refusal that waiting cannot cure (wrong user or password, a server certificate that does
        not verify) raises ``BusAuthError`` at once. ``name`` shows in the server's monitoring and
        in our logs. ``pending_bytes``: what may be published while disconnected, sent on
        reconnect."""
        auth = auth or BusAuth()
        connected = False
        holder: list[Bus] = []
        refused: asyncio.Future[Exception] = asyncio.get_running_loop().create_future()
        last_logged = [0.0]

        async def on_error(e: Exception) -> None:
            if not connected:
                if _is_refusal(e) and not refused.done():
                    refused.set_result(e)
                # Other errors before the first connection (refused, not up yet): retried quietly.
                return
            since = holder[0].disconnected_since if holder else None
            if since is None or not isinstance(e, OSError | nats.errors.Error | TimeoutError):
                log.warning("[%s] nats error: %r", name, e)
                return
            # A failed reconnect attempt: once when the outage begins, then every so often.
            now = time.monotonic()
            if last_logged[0] < since or now - last_logged[0] >= _STILL_DOWN_LOG_S:
                last_logged[0] = now
                log.warning(
                    "[%s] nats unreachable for %.1fs, still trying: %r", name, now - since, e
                )

        async def on_disconnected() -> None:
            if holder:
                holder[0]._lost()

        async def on_reconnected() -> None:
            if holder:
                holder[0]._back()

        def next_server(
            servers: list[_NatsServer], info: dict[str, Any]
        ) -> tuple[_NatsServer | None, float]:
            # One URL: the same server again, after the backoff its failed attempts call for.
            failed = max((s.reconnects for s in servers), default=0)
            return None, reconnect_delay_s(failed)

        # A user named only in the URL (nats://user:pass@host) gets that user's inbox prefix too.
        user = auth.user or urllib.parse.urlsplit(url).username or None
        options: dict[str, Any] = {}
        if auth.user is not None:
            options.update(user=auth.user, password=auth.password)
        if user is not None:
            options["inbox_prefix"] = inbox_prefix(user)
        where = f"NATS at {redact_url(url)}"
        try:
            context = auth.ssl_context()
        except OSError as e:  # ssl.SSLError included
            raise BusError(f"cannot use the TLS files for {where}: {e}") from None
        if context is not None:
            options["tls"] = context
        # With max_reconnect_attempts=-1 nats-py also retries the first connection forever, so the
        # deadline is ours.
        connecting = asyncio.ensure_future(
            nats.connect(
                servers=url,
                name=name,
                allow_reconnect=True,
                max_reconnect_attempts=-1,
                reconnect_time_wait=reconnect_wait_s,
                reconnect_to_server_handler=next_server,
                connect_timeout=2,
                ping_interval=5,
                max_outstanding_pings=3,
                pending_size=pending_bytes,
                error_cb=on_error,
                disconnected_cb=on_disconnected,
                reconnected_cb=on_reconnected,
                **options,
            )
        )
        waiters: set[asyncio.Future[Any]] = {connecting, refused}
        try:
            done, _ = await asyncio.wait(
                waiters,
                timeout=connect_timeout_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
            if connecting in done:
                nc = connecting.result()
            elif refused in done:
                raise BusAuthError(
                    f"{where} refused {_describe(auth, user)}: {_why(refused.result())}"
                )
            else:
                raise BusError(f"cannot connect to {where} within {connect_timeout_s}s")
        except (OSError, nats.errors.Error) as e:
            raise BusError(f"cannot connect to {where}: {e!r}") from e
        finally:
            if not connecting.done():
                connecting.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await connecting
        connected = True
        holder.append(cls(nc, name))
        return holder[0]

    @property
    def max_payload(self) -> int:
        """The server's limit on one message's size, in bytes."""
        return int(self._nc.max_payload)

    @property
    def is_connected(self) -> bool:
        return bool(self._nc.is_connected)

    async def publish(
        self, subject: str, data: bytes, headers: dict[str, str] | None = None
    ) -> None:
        try:
            await self._nc.publish(subject, data, headers=headers)
        except nats.errors.MaxPayloadError:
            raise BusError(
                f"message of {len(data)} bytes on {subject} exceeds the server's "
                f"max_payload of {self.max_payload} bytes"
            ) from None
        except _CONNECTION_ERRORS as e:
            raise BusError(f"cannot publish on {subject}: {e!r}") from None

    async def request(
        self, subject: str, data: bytes, timeout: float, headers: dict[str, str] | None = None
    ) -> bytes:
        """Send a request and return the reply's payload; ``BusTimeout`` if none comes in time."""
        try:
            msg = await self._nc.request(subject, data, timeout=timeout, headers=headers)
        except nats.errors.NoRespondersError:
            raise BusNoResponders(f"no service is listening on {subject}") from None
        except nats.errors.TimeoutError:
            raise BusTimeout(f"no reply on {subject} within {timeout}s") from None
        except nats.errors.MaxPayloadError:
            raise BusError(
                f"request of {len(data)} bytes on {subject} exceeds the server's "
                f"max_payload of {self.max_payload} bytes"
            ) from None
        except _CONNECTION_ERRORS as e:
            raise BusError(f"cannot request on {subject}: {e!r}") from None
        return msg.data

    async def subscribe(
        self, subject: str, handler: Handler, queue: str | None = None
    ) -> _NatsSubscription:
        """Run ``await handler(msg)`` for each message, one at a time, in arrival order. With
        ``queue``, each message goes to one member of the queue group. A handler's exception is
        logged and the subscription carries on. Returns the nats subscription
        (``.unsubscribe()``)."""

        async def guarded(msg: Msg) -> None:
            try:
                await handler(msg)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception(
                    "[%s] handler for %s failed on a message on %s", self.name, subject, msg.subject
                )

        return await self._nc.subscribe(
            subject,
            queue=queue or "",
            cb=guarded,
            pending_msgs_limit=PENDING_MSGS_LIMIT,
            pending_bytes_limit=PENDING_BYTES_LIMIT,
        )

    async def subscribe_iter(self, subject: str, queue: str | None = None) -> Subscription:
        """An iterator subscription (see ``Subscription``), e.g. one per request's stream."""
        sub = await self._nc.subscribe(
            subject,
            queue=queue or "",
            pending_msgs_limit=PENDING_MSGS_LIMIT,
            pending_bytes_limit=PENDING_BYTES_LIMIT,
        )
        return Subscription(sub)

    async def ensure_stream(
        self, name: str, subjects: list[str], *, max_age_s: float, max_bytes: int
    ) -> None:
        """Create the JetStream stream ``name`` over ``subjects`` (file storage, oldest messages
        dropped past ``max_age_s`` or ``max_bytes``), or leave it as it is if it exists: every
        process that needs it may call this, in any order."""
        config = nats.js.api.StreamConfig(
            name=name,
            subjects=subjects,
            retention=nats.js.api.RetentionPolicy.LIMITS,
            discard=nats.js.api.DiscardPolicy.OLD,
            storage=nats.js.api.StorageType.FILE,
            max_age=max_age_s,
            max_bytes=max_bytes,
        )
        js = self._nc.jetstream()
        try:
            await js.stream_info(name)
            return
        except nats.js.errors.NotFoundError:
            pass
        except nats.js.errors.Error as e:
            raise BusError(f"cannot read JetStream stream {name}: {e!r}") from None
        try:
            await js.add_stream(config)
        except nats.js.errors.BadRequestError as e:
            # Another process created it between our two calls: that one is as good as ours.
            if "already in use" not in str(e):
                raise BusError(f"cannot create JetStream stream {name}: {e!r}") from None
        except nats.js.errors.Error as e:
            raise BusError(f"cannot create JetStream stream {name}: {e!r}") from None

    async def pull_consumer(
        self, stream: str, subject: str, durable: str, *, ack_wait_s: float = 30.0
    ) -> PullConsumer:
        """Open (creating it if needed) the durable pull consumer ``durable`` on ``stream``'s
        ``subject``; it starts from the stream's first message and remembers acknowledgements
        across restarts."""
        config = nats.js.api.ConsumerConfig(
            durable_name=durable,
            ack_policy=nats.js.api.AckPolicy.EXPLICIT,
            deliver_policy=nats.js.api.DeliverPolicy.ALL,
            ack_wait=ack_wait_s,
            max_ack_pending=-1,
        )
        try:
            sub = await self._nc.jetstream().pull_subscribe(
                subject, durable=durable, stream=stream, config=config
            )
        except nats.js.errors.Error as e:
            raise BusError(f"cannot open consumer {durable} on {stream}: {e!r}") from None
        return PullConsumer(sub, subject)

    async def flush(self, timeout: float = 5.0) -> None:
        """Round trip to the server: everything sent before (SUBs included) has been processed."""
        try:
            # nats-py 2.16 writes flush()'s PING straight to the socket, while SUB and PUB commands
            # wait in its pending buffer for the flusher task: the PONG could come back before the
            # server had seen our SUBs (a subscriber then missed a request sent by another
            # connection right after). So first wait until the flusher has written the pending
            # buffer.
            async def written_then_acknowledged() -> None:
                await self._nc._flush_pending(force_flush=True)
                await self._nc.flush(timeout=timeout)  # type: ignore[arg-type]

            await asyncio.wait_for(written_then_acknowledged(), timeout)
        except (TimeoutError, nats.errors.TimeoutError):
            raise BusTimeout(f"flush not acknowledged within {timeout}s") from None

    async def drain(self) -> None:
        """Stop receiving, let handlers finish the messages already delivered, flush what was
        published, then close. Safe to call twice or after close."""
        if self._nc.is_closed or self._nc.is_draining:
            return
        self._closing = True
        try:
            await self._nc.drain()
        except (nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError):
            pass
        except Exception as e:  # a drain timeout must not stop a shutdown
            log.warning("[%s] drain failed (%r); closing", self.name, e)
            await self.close()

    async def close(self) -> None:
        """Close at once (pending handlers are cancelled). Idempotent."""
        self._closing = True
        if not self._nc.is_closed:
            await self._nc.close()

    async def __aenter__(self) -> Bus:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _notify(name: str, listeners: Sequence[Callable[[], None]]) -> None:
    for listener in listeners:
        try:
            listener()
        except Exception:  # one listener's bug must not keep the others from hearing it
            log.exception("[%s] a connection listener failed", name)
