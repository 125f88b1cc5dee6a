"""Subscriptions handed out by ``Bus``: an iterator over one subject's messages, and a JetStream
pull consumer. Both unsubscribe idempotently; nats-py's errors become ``BusError``s."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import nats.errors
import nats.js
import nats.js.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription as _NatsSubscription

from shared.wire.bus_errors import BusError, BusInterrupted, BusTimeout

__all__ = ["PullConsumer", "Subscription"]


async def _unsubscribe_quietly(
    sub: _NatsSubscription | nats.js.JetStreamContext.PullSubscription,
) -> None:
    """Unsubscribe; one already gone (or a connection closing) is fine: it is idempotent."""
    with contextlib.suppress(
        nats.errors.BadSubscriptionError,
        nats.errors.ConnectionClosedError,
        nats.errors.ConnectionDrainingError,
    ):
        await sub.unsubscribe()


class Subscription:
    """An iterator subscription: ``async for msg in sub`` or ``await sub.next(timeout)``.

    Use as an async context manager so it is always unsubscribed::

        async with await bus.subscribe_iter(subjects.stream(rid)) as sub:
            await bus.publish(...)
            async for msg in sub: ...
    """

    def __init__(self, sub: _NatsSubscription) -> None:
        self._sub = sub
        self.subject: str = sub.subject
        self._interrupted = False

    async def next(self, timeout: float | None = None) -> Msg:
        """The next message; ``BusTimeout`` if none arrives within ``timeout`` seconds (None =
        wait); ``BusInterrupted`` once ``interrupt()`` was called, even while waiting.

        It waits on nats-py's pending queue in the calling task, where ``next_msg`` would start a
        task, draw a uuid4 and wrap the wait in ``wait_for`` for every message: the gateway waits
        once per streamed token. The waiting task is registered where nats-py keeps its own
        ``next_msg`` waiters, so a closing connection cancels it as it cancels those."""
        if self._interrupted:
            raise BusInterrupted(f"stopped waiting on {self.subject}")
        sub = self._sub
        if sub._conn.is_closed:
            raise self._closed()
        queue = sub._pending_queue
        if queue.empty():
            task = asyncio.current_task()
            assert task is not None, "next() runs in a task"
            waiters = sub._pending_next_msgs_calls
            key = str(id(task))
            waiters[key] = task
            try:
                async with asyncio.timeout(timeout):
                    msg = await queue.get()
            except TimeoutError:
                if sub._conn.is_closed:
                    raise self._closed() from None
                raise BusTimeout(f"no message on {self.subject} within {timeout}s") from None
            except asyncio.CancelledError:
                # interrupt() and a closing connection take the waiter out of ``waiters`` as they
                # cancel it: then this task goes on, with the error. A cancellation of the task
                # itself (alone, or still pending once that one is taken back) is passed on.
                if key not in waiters and task.uncancel() == 0:
                    if self._interrupted:
                        raise BusInterrupted(f"stopped waiting on {self.subject}") from None
                    raise self._closed() from None
                raise
            finally:
                waiters.pop(key, None)
        else:
            msg = queue.get_nowait()
        # As next_msg does: a message handed out no longer counts against the pending limits.
        sub._pending_size -= len(msg.data)
        queue.task_done()
        return msg

    def _closed(self) -> BusError:
        return BusError(f"connection closed while waiting on {self.subject}")

    def interrupt(self) -> None:
        """Make a pending ``next()``, and every later one, raise ``BusInterrupted``. Messages
        already buffered are not delivered."""
        self._interrupted = True
        waiters = self._sub._pending_next_msgs_calls
        for key in list(waiters):
            waiters.pop(key).cancel()

    def __aiter__(self) -> AsyncIterator[Msg]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Msg]:
        while True:
            try:
                yield await self.next(None)
            except BusError:
                return

    async def unsubscribe(self) -> None:
        await _unsubscribe_quietly(self._sub)

    async def __aenter__(self) -> Subscription:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.unsubscribe()


class PullConsumer:
    """A durable JetStream pull consumer shared by every process that opens it with the same name:
    each stored message goes to one of them (a consumer group). Messages must be acknowledged
    (``await msg.ack()``), or ``await msg.nak(delay=s)`` to have them redelivered; one not
    acknowledged within the consumer's ack wait is redelivered too. ``msg.metadata`` carries the
    stream sequence, the publish timestamp and the delivery count."""

    def __init__(self, sub: nats.js.JetStreamContext.PullSubscription, subject: str) -> None:
        self._sub = sub
        self.subject = subject

    async def fetch(self, max_msgs: int, timeout: float) -> list[Msg]:
        """Up to ``max_msgs`` messages; an empty list if none arrives within ``timeout``."""
        try:
            return await self._sub.fetch(max_msgs, timeout=timeout)
        except (nats.errors.TimeoutError, TimeoutError):
            return []
        except (nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError) as e:
            raise BusError(f"cannot fetch from {self.subject}: {e!r}") from None
        except nats.js.errors.Error as e:
            raise BusError(f"cannot fetch from {self.subject}: {e!r}") from None

    async def unsubscribe(self) -> None:
        await _unsubscribe_quietly(self._sub)
