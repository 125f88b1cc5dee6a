"""The tokenizer service over a real nats-server: chat and text requests reach SCHEDULER_SUBMIT as
ids + block hashes, bad ones end on the request's stream with a 400 StreamError; and the
``python -m services.tokenizer`` process itself starts, serves and drains on SIGTERM."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
import uuid
from typing import Any

import msgspec
import pytest

from helpers.tiny_llama import save_tiny_tokenizer
from services.tokenizer.prompts import (
    ModelTokenizer,
    PromptError,
    PromptLimits,
    UnknownModelError,
    model_context_len,
    select_model,
    tokenize_request,
)
from services.tokenizer.service import SUBMIT_ACK_TIMEOUT_S, TokenizerService
from shared.engine.tokenizer import Tokenizer
from shared.wire import messages, subjects
from shared.wire.block_hash import hash_prompt_blocks
from shared.wire.bus import Bus
from shared.wire.keepalive import KEEPALIVE_INTERVAL_S
from shared.wire.messages import ChatMessage, GenerateRequest, SamplingParams, StreamError

LIMITS = PromptLimits(max_model_len=64, block_size=4)


def gen(**kw) -> GenerateRequest:
    kw.setdefault("params", SamplingParams(max_tokens=8))
    return GenerateRequest(request_id=kw.pop("request_id", uuid.uuid4().hex), model="m", **kw)


# -- pure logic ----------------------------------------------------------------------------------


def test_chat_is_rendered_with_the_template(smollm2_tokenizer):
    req = gen(
        messages=[ChatMessage(role="user", content="What is 2+2?")], priority=3, deadline=99.0
    )
    out = tokenize_request(req, smollm2_tokenizer, LIMITS)
    text = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert out.prompt_token_ids == smollm2_tokenizer.encode(text, add_special_tokens=False)
    assert out.block_hashes == hash_prompt_blocks(out.prompt_token_ids, 4)
    assert (out.model, out.priority, out.deadline, out.params) == ("m", 3, 99.0, req.params)


def test_text_and_ids(smollm2_tokenizer):
    out = tokenize_request(gen(prompt="Hello there"), smollm2_tokenizer, LIMITS)
    assert out.prompt_token_ids == smollm2_tokenizer.encode("Hello there")
    ids = [1, 2, 3, 4, 5]
    assert (
        tokenize_request(gen(prompt_token_ids=ids), smollm2_tokenizer, LIMITS).prompt_token_ids
        == ids
    )


@pytest.mark.parametrize(
    "kw, match, param",
    [
        (dict(prompt=""), "must not be empty", "prompt"),
        (dict(messages=[]), "must not be empty", "messages"),
        (dict(), "exactly one of", "prompt"),
        (dict(prompt="a", prompt_token_ids=[1]), "exactly one of", "prompt"),
        (dict(prompt_token_ids=[10**9]), r"must be in \[0, ", "prompt"),
        (dict(prompt="word " * 100), "maximum context length is 64 tokens", "prompt"),
        (
            dict(prompt="word " * 30, params=SamplingParams(max_tokens=40)),
            "maximum context length",
            "max_tokens",
        ),
    ],
)
def test_rejections(smollm2_tokenizer, kw, match, param):
    with pytest.raises(PromptError, match=match) as e:
        tokenize_request(gen(**kw), smollm2_tokenizer, LIMITS)
    assert e.value.param == param


def test_too_long_message_names_both_numbers(smollm2_tokenizer):
    prompt = "word " * 30
    num_prompt = len(smollm2_tokenizer.encode(prompt))
    with pytest.raises(PromptError) as e:
        tokenize_request(
            gen(prompt=prompt, params=SamplingParams(max_tokens=40)), smollm2_tokenizer, LIMITS
        )
    text = str(e.value)
    assert "maximum context length is 64 tokens" in text and "40 for the completion" in text
    assert f"requested {num_prompt + 40} tokens ({num_prompt} in the prompt" in text


def test_prompt_filling_the_context_without_max_tokens_is_rejected(smollm2_tokenizer):
    ids = list(range(1, 65))
    with pytest.raises(PromptError, match="maximum context length"):
        tokenize_request(
            gen(prompt_token_ids=ids, params=SamplingParams(max_tokens=None)),
            smollm2_tokenizer,
            LIMITS,
        )
    assert (
        tokenize_request(
            gen(prompt_token_ids=ids[:-1], params=SamplingParams(max_tokens=None)),
            smollm2_tokenizer,
            LIMITS,
        ).prompt_token_ids
        == ids[:-1]
    )


def test_model_context_len_from_metadata(smollm2_path):
    assert model_context_len(smollm2_path) == 8192


def test_an_unknown_model_is_the_schedulers_404(smollm2_tokenizer):
    models = {
        "b": ModelTokenizer(smollm2_tokenizer, LIMITS),
        "a": ModelTokenizer(smollm2_tokenizer, LIMITS),
    }
    assert select_model(models, "a") is models["a"]
    with pytest.raises(UnknownModelError) as e:
        select_model(models, "gpt-5")
    error = e.value.to_stream_error("r1")
    assert (error.status, error.type, error.param) == (404, "invalid_request_error", "model")
    assert error.message == "The model 'gpt-5' does not exist. This server serves 'a, b'."


# -- over NATS -----------------------------------------------------------------------------------


async def _roundtrip(bus: Bus, req: GenerateRequest) -> tuple[str, Any]:
    """Send like the gateway (stream subscribed first, then a request the tokenizer acks) and return
    where the answer went."""
    async with (
        await bus.subscribe_iter(subjects.stream(req.request_id)) as stream,
        await bus.subscribe_iter(subjects.SCHEDULER_SUBMIT) as submit,
    ):
        ack = await bus.request(
            subjects.TOKENIZER_GENERATE,
            messages.GENERATE_REQUEST.encode(req),
            timeout=5,
            headers={"traceparent": "00-abc-def-01"},
        )
        assert ack == b""
        done, pending = await asyncio.wait(
            [asyncio.ensure_future(stream.next(5)), asyncio.ensure_future(submit.next(5))],
            return_when=asyncio.FIRST_COMPLETED,
        )
        for t in pending:
            t.cancel()
        msg = done.pop().result()
        if msg.subject == subjects.SCHEDULER_SUBMIT:
            await msg.respond(b"")  # as the scheduler acks
            assert msg.headers and msg.headers.get("traceparent") == "00-abc-def-01"
            return "submit", messages.TOKENIZED_REQUEST.decode(msg.data)
        return "stream", messages.STREAM_MESSAGE.decode(msg.data)


def test_service_over_nats(nats_url, smollm2_tokenizer):
    async def main() -> None:
        service_bus = await Bus.connect(nats_url, "tokenizer-test")
        await TokenizerService(
            service_bus, {"m": ModelTokenizer(smollm2_tokenizer, LIMITS)}
        ).start()
        client = await Bus.connect(nats_url, "gateway-test")
        try:
            where, out = await _roundtrip(
                client, gen(messages=[ChatMessage(role="user", content="Hi")])
            )
            assert where == "submit" and out.prompt_token_ids[:1] == [1]
            where, out = await _roundtrip(client, gen(prompt="Hello"))
            assert where == "submit" and out.prompt_token_ids == smollm2_tokenizer.encode("Hello")
            req = gen(prompt="word " * 100)
            where, out = await _roundtrip(client, req)
            assert where == "stream" and isinstance(out, StreamError)
            assert (out.request_id, out.status, out.type) == (
                req.request_id,
                400,
                "invalid_request_error",
            )
            assert "maximum context length is 64" in out.message
            # A malformed message is dropped without killing the subscription.
            await client.publish(subjects.TOKENIZER_GENERATE, b"\x00garbage")
            where, _ = await _roundtrip(client, gen(prompt="still alive"))
            assert where == "submit"
            # The status the gateway's /health asks for.
            status = messages.TOKENIZER_STATUS.decode(
                await client.request(
                    subjects.TOKENIZER_STATUS,
                    messages.TOKENIZER_STATUS_REQUEST.encode(messages.TokenizerStatusRequest()),
                    timeout=5,
                )
            )
            assert status.models == [
                messages.TokenizerModelStatus(
                    name="m", max_model_len=LIMITS.max_model_len, block_size=LIMITS.block_size
                )
            ]
            # No scheduler listening: the request ends at once with a 503 on its stream.
            req = gen(prompt="nobody routes this")
            async with await client.subscribe_iter(subjects.stream(req.request_id)) as stream:
                await client.request(
                    subjects.TOKENIZER_GENERATE, messages.GENERATE_REQUEST.encode(req), timeout=5
                )
                out = messages.STREAM_MESSAGE.decode((await stream.next(2)).data)
            assert isinstance(out, StreamError) and (out.status, out.message) == (
                503,
                "No scheduler is running.",
            )
        finally:
            await client.close()
            await service_bus.close()

    asyncio.run(main())


def test_each_model_has_its_own_tokenizer_template_and_limits(
    nats_url, smollm2_tokenizer, tmp_path
):
    """Two models in one tokenizer: the request's ``model`` picks the vocabulary, the chat template,
    the context length and the block size; the status lists both; any other model is a 404 on the
    request's stream."""
    save_tiny_tokenizer(tmp_path)
    tiny = Tokenizer.from_path(tmp_path)
    tiny_limits = PromptLimits(max_model_len=40, block_size=2)
    models = {
        "smol": ModelTokenizer(smollm2_tokenizer, LIMITS),
        "tiny": ModelTokenizer(tiny, tiny_limits),
    }
    chat = [ChatMessage(role="user", content="Hi")]

    def for_model(model: str, **kw: Any) -> GenerateRequest:
        return msgspec.structs.replace(gen(**kw), model=model)

    async def main() -> None:
        service_bus = await Bus.connect(nats_url, "tokenizer-test")
        await TokenizerService(service_bus, models).start()
        client = await Bus.connect(nats_url, "gateway-test")
        try:
            where, out = await _roundtrip(client, for_model("tiny", prompt="Hello"))
            assert where == "submit" and out.model == "tiny"
            assert out.prompt_token_ids == tiny.encode("Hello") == [0, 41, 70, 77, 77, 80]
            assert out.block_hashes == hash_prompt_blocks(out.prompt_token_ids, 2)
            where, out = await _roundtrip(client, for_model("smol", prompt="Hello"))
            assert (where, out.model) == ("submit", "smol")
            assert out.prompt_token_ids == smollm2_tokenizer.encode("Hello")
            assert out.block_hashes == hash_prompt_blocks(out.prompt_token_ids, 4)
            where, out = await _roundtrip(client, for_model("tiny", messages=chat))
            assert where == "submit"
            assert tiny.decode(out.prompt_token_ids, skip_special_tokens=False) == (
                "<s>[user] Hi\n[assistant] "
            )
            # 40 byte tokens for tiny, past its context of 40; far fewer and within 64 for smol.
            where, out = await _roundtrip(client, for_model("smol", prompt="x" * 39))
            assert where == "submit"
            where, out = await _roundtrip(client, for_model("tiny", prompt="x" * 39))
            assert where == "stream" and isinstance(out, StreamError) and out.status == 400
            assert "maximum context length is 40 tokens" in out.message
            where, out = await _roundtrip(client, for_model("gpt-5", prompt="Hello"))
            assert where == "stream" and isinstance(out, StreamError)
            assert (out.status, out.param, out.message) == (
                404,
                "model",
                "The model 'gpt-5' does not exist. This server serves 'smol, tiny'.",
            )
            status = messages.TOKENIZER_STATUS.decode(
                await client.request(
                    subjects.TOKENIZER_STATUS,
                    messages.TOKENIZER_STATUS_REQUEST.encode(messages.TokenizerStatusRequest()),
                    timeout=5,
                )
            )
            assert {(m.name, m.max_model_len, m.block_size) for m in status.models} == {
                ("smol", 64, 4),
                ("tiny", 40, 2),
            }
        finally:
            await client.close()
            await service_bus.close()

    asyncio.run(main())


def test_a_slow_scheduler_ack_does_not_hold_back_the_next_requests(nats_url, smollm2_tokenizer):
    """Eight requests in a burst, against a scheduler that reads submits only after the burst and
    acks each 0.4 s after it arrives: the tokenizer takes all eight and they reach the scheduler
    within one ack delay (when it waited for each ack before taking the next request, the second
    hand-off timed out here), and ``stop`` returns only once every ack is in, with no request ended
    by an error."""
    ack_delay_s, count = 0.4, 8

    async def main() -> None:
        service_bus = await Bus.connect(nats_url, "tokenizer-test")
        service = TokenizerService(service_bus, {"m": ModelTokenizer(smollm2_tokenizer, LIMITS)})
        await service.start()
        scheduler = await Bus.connect(nats_url, "scheduler-test")
        client = await Bus.connect(nats_url, "gateway-test")
        loop = asyncio.get_running_loop()
        arrived: list[float] = []
        acked: list[float] = []

        async def ack_later(msg) -> None:
            await asyncio.sleep(ack_delay_s)
            await msg.respond(b"")
            acked.append(loop.time())

        try:
            reqs = [gen(prompt=f"request {i}") for i in range(count)]
            async with (
                await scheduler.subscribe_iter(subjects.SCHEDULER_SUBMIT) as submit,
                await client.subscribe_iter(subjects.STREAM_ALL) as streams,
            ):
                acks = []
                for (
                    req
                ) in reqs:  # as the gateway sends them: each acked by the tokenizer on receipt
                    await client.request(
                        subjects.TOKENIZER_GENERATE,
                        messages.GENERATE_REQUEST.encode(req),
                        timeout=5,
                    )
                for _ in reqs:
                    msg = await submit.next(5)
                    arrived.append(loop.time())
                    acks.append(asyncio.create_task(ack_later(msg)))
                assert arrived[-1] - arrived[0] < ack_delay_s
                await service.stop()
                stopped = loop.time()
                assert len(acked) == count and stopped >= max(acked)
                await asyncio.gather(*acks)
                with pytest.raises(TimeoutError):  # nothing was ended on its stream
                    await streams.next(0.2)
        finally:
            await client.close()
            await scheduler.close()
            await service_bus.close()

    asyncio.run(main())


def test_process_serves_and_drains_on_sigterm(nats_url):
    env = {**os.environ, "NATS_URL": nats_url}
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.tokenizer", "--max-model-len", "32", "--model-name", "m"],
        env=env,
        stderr=subprocess.PIPE,
    )
    try:

        async def main() -> None:
            async with await Bus.connect(nats_url, "gateway-test") as client:
                req = gen(prompt="word " * 40)
                for _ in range(100):  # until the process has subscribed
                    async with await client.subscribe_iter(
                        subjects.stream(req.request_id)
                    ) as stream:
                        await client.publish(
                            subjects.TOKENIZER_GENERATE, messages.GENERATE_REQUEST.encode(req)
                        )
                        try:
                            out = messages.STREAM_MESSAGE.decode((await stream.next(0.2)).data)
                            break
                        except TimeoutError:
                            continue
                else:
                    raise AssertionError("the tokenizer process never answered")
                assert (
                    isinstance(out, StreamError) and "maximum context length is 32" in out.message
                )

        asyncio.run(main())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_a_held_request_gets_keepalives_and_a_bounded_end(nats_url, smollm2_tokenizer):
    """A scheduler that takes submits but never acks: the tokenizer holds the request, says so on
    its stream every keepalive interval (the gateway's progress clock), and after its ack timeout
    ends it with a 503 and an abort: held, never hanging, never silent."""

    async def main() -> None:
        service_bus = await Bus.connect(nats_url, "tokenizer-test")
        service = TokenizerService(service_bus, {"m": ModelTokenizer(smollm2_tokenizer, LIMITS)})
        await service.start()
        client = await Bus.connect(nats_url, "gateway-test")
        try:
            req = gen(prompt="hold me")
            async with (
                await client.subscribe_iter(subjects.SCHEDULER_SUBMIT) as submits,
                await client.subscribe_iter(subjects.ABORT) as aborts,
                await client.subscribe_iter(subjects.stream(req.request_id)) as stream,
            ):
                await client.request(
                    subjects.TOKENIZER_GENERATE, messages.GENERATE_REQUEST.encode(req), timeout=5
                )
                loop = asyncio.get_running_loop()
                acked_at = loop.time()
                await submits.next(5)  # taken, never acked
                assert service.num_held == 1
                seen = []
                while True:
                    out = messages.STREAM_MESSAGE.decode((await stream.next(10)).data)
                    seen.append((loop.time() - acked_at, out))
                    if isinstance(out, StreamError):
                        break
                keepalives = [(t, k) for t, k in seen if isinstance(k, messages.StreamKeepalive)]
                assert [(k.holder, k.state) for _, k in keepalives] == [
                    ("tokenizer", "submitting")
                ] * len(keepalives)
                assert len(keepalives) >= int(SUBMIT_ACK_TIMEOUT_S / KEEPALIVE_INTERVAL_S) - 1
                times = [0.0] + [t for t, _ in seen]  # from the ack, each message's arrival
                gaps = [b - a for a, b in itertools.pairwise(times)]
                assert max(gaps) < 2 * KEEPALIVE_INTERVAL_S  # never silent for long
                end_t, error = seen[-1]
                assert isinstance(error, StreamError) and error.status == 503
                assert end_t < SUBMIT_ACK_TIMEOUT_S + 2
                abort = messages.ABORT_REQUEST.decode((await aborts.next(5)).data)
                assert abort.request_id == req.request_id
                assert service.num_held == 0
        finally:
            await service.stop()
            await client.close()
            await service_bus.close()

    asyncio.run(main())
