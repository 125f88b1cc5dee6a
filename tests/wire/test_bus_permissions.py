"""The closed bus against a real nats-server configured as ``llmserve up`` configures its own
(services/cli/credentials.py from shared/wire/permissions.py): a client without the stack's
credentials cannot connect at all; each service's user may publish and subscribe to what its table
grants and nothing else, so no service can watch everything or read another's replies; a wrong
password fails at once, naming the server and the user.

The server is asked directly (helpers/nats_probe.py: the bare protocol, no client library between
the test and the server's -ERR), and through ``Bus`` where the service code's view matters."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Iterator

import pytest

from helpers.nats_probe import ConnectRefused, NatsProbe
from services.cli.credentials import StackCredentials
from services.cli.servers import ServerProcess, start_nats
from shared.wire import subjects
from shared.wire.bus import Bus, BusAuthError, BusTimeout
from shared.wire.bus_auth import BusAuth
from shared.wire.permissions import ADMIN_USER, PERMISSIONS, SERVICE_KINDS


@pytest.fixture(scope="module")
def closed() -> Iterator[tuple[ServerProcess, StackCredentials]]:
    credentials = StackCredentials.generate()
    server = start_nats(extra_config=credentials.nats_authorization())
    yield server, credentials
    server.stop()


def probe(server: ServerProcess, credentials: StackCredentials, user: str) -> NatsProbe:
    return NatsProbe(server.host, server.port, user, credentials.nats_passwords[user])


def every_concrete_subject() -> list[str]:
    """Every subject of shared/wire/subjects.py: its constants, and each builder with a sample id
    (so a subject added there is checked here without a change to this test)."""
    constants = [
        v
        for k, v in vars(subjects).items()
        if k.isupper() and isinstance(v, str) and v.startswith(subjects.PREFIX + ".")
    ]
    builders = [
        f(*(f"x-{i}-{j}" for j in range(len(inspect.signature(f).parameters))))
        for i, (name, f) in enumerate(inspect.getmembers(subjects, inspect.isfunction))
        if not name.startswith("_") and f.__module__ == subjects.__name__
    ]
    return sorted({s for s in constants + builders if "*" not in s and ">" not in s})


def granted(patterns: tuple[str, ...], subject: str) -> bool:
    """NATS subject matching of a concrete ``subject`` against permission patterns."""

    def match(pattern: str) -> bool:
        p, s = pattern.split("."), subject.split(".")
        for i, token in enumerate(p):
            if token == ">":
                return len(s) > i
            if i >= len(s) or (token != "*" and token != s[i]):
                return False
        return len(p) == len(s)

    return any(match(p) for p in patterns)


def test_a_client_without_the_stacks_credentials_cannot_connect(closed):
    server, credentials = closed
    for user, password in ((None, None), ("gateway", "wrong"), ("nobody", "x")):
        with pytest.raises(ConnectRefused, match="Authorization Violation"):
            NatsProbe(server.host, server.port, user, password)

    wrong = "not-the-password-7731"
    tokenizers = credentials.nats_passwords["tokenizer"]

    async def main() -> None:
        for auth, named in (
            (BusAuth(), "no user"),
            (BusAuth(user="scheduler", password=wrong), "user 'scheduler'"),
            (BusAuth(user="executor", password=tokenizers), "user 'executor'"),
        ):
            t0 = time.monotonic()
            with pytest.raises(BusAuthError) as err:
                await Bus.connect(server.url, "stranger", auth=auth, connect_timeout_s=30)
            # At once, not after the 30 s a server that is down would get.
            assert time.monotonic() - t0 < 5
            assert server.url in str(err.value) and named in str(err.value)
            # No password is ever in a message.
            assert wrong not in str(err.value) and tokenizers not in str(err.value)

    asyncio.run(main())


def test_each_service_uses_exactly_the_subjects_its_table_grants(closed):
    server, credentials = closed
    concrete = every_concrete_subject()
    assert len(concrete) >= 13
    for user in SERVICE_KINDS:
        grants = PERMISSIONS[user]
        with probe(server, credentials, user) as p:
            for subject in concrete:
                assert p.can_publish(subject) == granted(grants.publish, subject), (user, subject)
                assert p.can_subscribe(subject) == granted(grants.subscribe, subject), (
                    user,
                    subject,
                )


def test_who_reads_prompts_and_outputs(closed):
    """The table's intent, named: only the tokenizer reads requests as sent, only the scheduler
    their token ids, only executors their work, only the gateway their outputs; and work enters
    each stage only from the stage before it."""
    server, credentials = closed
    rid = "req-1"
    readers = {
        subjects.TOKENIZER_GENERATE: {"tokenizer"},  # the prompt, as the client sent it
        subjects.SCHEDULER_SUBMIT: {"scheduler"},  # its token ids
        subjects.executor_decode("executor-0"): {"executor"},
        subjects.stream(rid): {"gateway"},  # the output
    }
    for subject, allowed in readers.items():
        for user in SERVICE_KINDS:
            with probe(server, credentials, user) as p:
                assert p.can_subscribe(subject) == (user in allowed), (user, subject)
    # Who may inject: work only from the stage before it.
    with probe(server, credentials, "gateway") as p:
        assert not p.can_publish(subjects.SCHEDULER_SUBMIT)  # no skipping the tokenizer's checks
        assert not p.can_publish(subjects.executor_decode("executor-0"))
    with probe(server, credentials, "executor") as p:
        assert not p.can_publish(subjects.TOKENIZER_GENERATE)


def test_no_service_can_watch_everything_or_read_anothers_replies(closed):
    server, credentials = closed
    broad = [">", "llm.>", f"{subjects.PREFIX}.>", "_INBOX.>", "*.>", "$JS.API.>"]
    for user in SERVICE_KINDS:
        with probe(server, credentials, user) as p:
            for subject in broad:
                assert not p.can_subscribe(subject), (user, subject)
                assert not p.can_publish(subject), (user, subject)
            for other in SERVICE_KINDS:
                inbox = f"_INBOX.{other}.abc.1"
                assert p.can_subscribe(inbox) == (other == user), (user, inbox)
    with probe(server, credentials, ADMIN_USER) as p:  # operators and tests
        assert all(p.can_subscribe(s) for s in broad)


def test_jetstream_only_on_the_kv_events_stream_and_never_its_deletion(closed):
    server, credentials = closed
    stream = subjects.KV_EVENTS_STREAM
    with probe(server, credentials, "executor") as p:
        assert p.can_publish(f"$JS.API.STREAM.CREATE.{stream}")
        assert not p.can_publish(f"$JS.API.STREAM.DELETE.{stream}")
        assert not p.can_publish(f"$JS.API.STREAM.PURGE.{stream}")
        assert not p.can_publish("$JS.API.STREAM.CREATE.OTHER")
        assert not p.can_publish(f"$JS.API.CONSUMER.MSG.NEXT.{stream}.prefix_index")
    with probe(server, credentials, "prefix_index") as p:
        assert p.can_publish(f"$JS.API.CONSUMER.MSG.NEXT.{stream}.prefix_index")
        assert p.can_publish(f"$JS.ACK.{stream}.prefix_index.1.2.3.4.5")
        assert not p.can_publish(f"$JS.API.CONSUMER.DELETE.{stream}.prefix_index")
    for user in ("gateway", "tokenizer", "scheduler"):
        with probe(server, credentials, user) as p:
            assert not p.can_publish(f"$JS.API.STREAM.INFO.{stream}")


def test_a_watcher_sees_no_prompt_while_the_services_talk(closed):
    """What finding 4 did (a process subscribed to '>' read another user's prompt), tried with
    every credential but the admin's: the request still flows, the watcher gets nothing."""
    server, credentials = closed

    async def main() -> None:
        tokenizer = await Bus.connect(server.url, "t", auth=credentials.nats_auth("tokenizer"))
        gateway = await Bus.connect(server.url, "g", auth=credentials.nats_auth("gateway"))
        received: list[bytes] = []

        async def on_generate(msg) -> None:
            received.append(msg.data)
            await msg.respond(b"")

        await tokenizer.subscribe(subjects.TOKENIZER_GENERATE, on_generate, queue="tokenizer")
        await tokenizer.flush()
        watchers, buses = [], [tokenizer, gateway]
        for user in ("gateway", "scheduler", "executor", "prefix_index"):
            bus = await Bus.connect(server.url, f"watch-{user}", auth=credentials.nats_auth(user))
            buses.append(bus)
            for subject in (">", subjects.TOKENIZER_GENERATE):
                watchers.append(await bus.subscribe_iter(subject))
            await bus.flush()
        secret = b"my bank password is hunter2"
        await gateway.request(subjects.TOKENIZER_GENERATE, secret, timeout=5)
        assert received == [secret]
        for sub in watchers:
            with pytest.raises(BusTimeout):
                await sub.next(timeout=0.2)
        with pytest.raises(BusAuthError):
            await Bus.connect(server.url, "anonymous", connect_timeout_s=5)
        for bus in buses:
            await bus.close()

    asyncio.run(main())
