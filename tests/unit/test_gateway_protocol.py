"""Pure gateway logic, synchronously: request validation and conversion, and the exact JSON shapes
of OpenAI's completion / chat objects and stream chunks (platform.openai.com/docs/api-reference)."""

from __future__ import annotations

import json

import pytest

from services.gateway import protocol
from services.gateway.errors import APIError, from_stream_error, model_not_found, route_not_found
from services.gateway.openai_schema import parse_chat_request, parse_completion_request
from shared.wire.messages import StreamError
from shared.wire.outputs import CompletionDelta, RequestOutput, TokenLogprobs

LIMITS = protocol.Limits(max_tokens_default=None)


def completion(**body) -> protocol.GenerateRequest:
    req = parse_completion_request(json.dumps({"model": "m", "prompt": "hi", **body}).encode())
    return protocol.completion_to_generate(
        req, request_id="cmpl-1", limits=LIMITS, arrival_time=1.0, deadline=2.0
    )


def chat(**body) -> protocol.GenerateRequest:
    req = parse_chat_request(
        json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}).encode()
    )
    return protocol.chat_to_generate(
        req, request_id="chatcmpl-1", limits=LIMITS, arrival_time=1.0, deadline=2.0
    )


def error_of(fn, **body) -> APIError:
    with pytest.raises(APIError) as e:
        fn(**body)
    return e.value


# ---------------------------------------------------------------------------------- inbound


def test_completion_maps_every_parameter():
    g = completion(
        n=2,
        stop="\n",
        seed=7,
        logprobs=3,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        max_tokens=12,
        user="u",
        ignore_eos=True,
        stop_token_ids=[2],
        priority=3,
        speculative=False,
        some_unknown_field={"x": 1},
    )
    p = g.params
    assert (p.n, p.stop, p.seed, p.logprobs, p.temperature, p.top_p, p.top_k, p.min_p) == (
        2,
        ["\n"],
        7,
        3,
        0.5,
        0.9,
        40,
        0.05,
    )
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty, p.max_tokens) == (
        1.1,
        0.5,
        -0.5,
        12,
    )
    assert p.ignore_eos and p.stop_token_ids == [2] and p.speculative is False
    assert (g.request_id, g.model, g.prompt, g.prompt_token_ids, g.messages) == (
        "cmpl-1",
        "m",
        "hi",
        None,
        None,
    )
    assert (g.priority, g.arrival_time, g.deadline) == (3, 1.0, 2.0)


def test_completion_defaults_and_prompt_forms():
    assert completion().params.max_tokens == protocol.COMPLETIONS_DEFAULT_MAX_TOKENS
    assert completion().params.logprobs is None and completion().params.temperature == 1.0
    assert completion().params.speculative is True
    assert completion(prompt=[1, 2, 3]).prompt_token_ids == [1, 2, 3]
    assert completion(prompt=["one"]).prompt == "one"
    assert completion(prompt=[[4, 5]]).prompt_token_ids == [4, 5]
    assert completion(stop=["a", "b"]).params.stop == ["a", "b"]
    limits = protocol.Limits(max_tokens_default=99)
    req = parse_completion_request(b'{"model": "m", "prompt": "x"}')
    assert (
        protocol.completion_to_generate(
            req, request_id="r", limits=limits, arrival_time=0, deadline=None
        ).params.max_tokens
        == 99
    )


def test_chat_maps_messages_and_chat_only_parameters():
    g = chat(
        messages=[
            {"role": "developer", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": None},
        ],
        logprobs=True,
        top_logprobs=2,
        max_completion_tokens=5,
        max_tokens=50,
    )
    assert g.messages is not None
    assert [(m.role, m.content) for m in g.messages] == [
        ("system", "be brief"),
        ("user", "a\nb"),
        ("assistant", ""),
    ]
    assert g.params.logprobs == 2 and g.params.max_tokens == 5  # max_completion_tokens wins
    assert g.add_generation_prompt and g.prompt is None
    assert chat().params.max_tokens is None  # chat: until the context is full
    assert chat(logprobs=True).params.logprobs == 0
    assert chat(max_tokens=7).params.max_tokens == 7


@pytest.mark.parametrize(
    "fn, body, param",
    [
        (completion, {"max_tokens": 0}, "max_tokens"),
        (completion, {"max_tokens": -3}, "max_tokens"),
        (completion, {"temperature": -0.1}, "temperature"),
        (completion, {"top_p": 0}, "top_p"),
        (completion, {"top_p": 1.5}, "top_p"),
        (completion, {"n": 0}, "n"),
        (completion, {"n": 1000}, "n"),
        (completion, {"logprobs": 50}, "logprobs"),
        (completion, {"presence_penalty": 3}, "presence_penalty"),
        (completion, {"stop": [""]}, "stop"),
        (completion, {"prompt": []}, "prompt"),
        (completion, {"prompt": ["a", "b"]}, "prompt"),
        (completion, {"prompt": [1, -1]}, "prompt"),
        (completion, {"echo": True}, "echo"),
        (completion, {"best_of": 3}, "best_of"),
        (completion, {"logit_bias": {"1": 5}}, "logit_bias"),
        (chat, {"top_logprobs": 3}, "top_logprobs"),
        (chat, {"logprobs": True, "top_logprobs": 99}, "top_logprobs"),
        (chat, {"max_completion_tokens": 0}, "max_completion_tokens"),
        (chat, {"tools": [{"type": "function"}]}, "tools"),
        (chat, {"response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_out_of_range_values_are_400_naming_the_field(fn, body, param):
    e = error_of(fn, **body)
    assert e.status == 400 and e.param == param and e.type == "invalid_request_error"
    assert param in e.message


@pytest.mark.parametrize(
    "raw, param",
    [
        (b"{not json", None),
        (b"[1]", None),
        (b'{"prompt": "x"}', "model"),
        (b'{"model": "m"}', "prompt"),
        (b'{"model": "m", "prompt": "x", "max_tokens": 2.5}', "max_tokens"),
        (b'{"model": "m", "prompt": "x", "max_tokens": "5"}', "max_tokens"),
        (b'{"model": "m", "prompt": "x", "n": true}', "n"),
        (b'{"model": "m", "prompt": "x", "stop": 3}', "stop"),
        (b'{"model": "m", "prompt": {"a": 1}}', "prompt"),
    ],
)
def test_malformed_bodies_are_400(raw, param):
    with pytest.raises(APIError) as e:
        parse_completion_request(raw)
    assert e.value.status == 400 and e.value.param == param
    assert set(e.value.body()["error"]) == {"message", "type", "param", "code"}


def test_model_is_carried_and_the_routers_404_is_model_not_found():
    """The gateway checks the name against the served set before conversion (test_gateway_http);
    conversion carries it, and the scheduler's 404 (no executor serves it) reads as OpenAI's."""
    req = parse_completion_request(b'{"model": "other", "prompt": "x"}')
    g = protocol.completion_to_generate(
        req, request_id="r", limits=LIMITS, arrival_time=0, deadline=None
    )
    assert g.model == "other"
    e = from_stream_error(
        StreamError(
            request_id="r",
            status=404,
            type="invalid_request_error",
            param="model",
            message="The model 'other' does not exist. This server serves 'm'.",
        )
    )
    assert e.status == 404 and e.code == "model_not_found" and e.param == "model"


def test_stream_errors_pass_through_with_status_and_retry_after():
    e = from_stream_error(
        StreamError(request_id="r", status=429, message="queue full", retry_after_s=1.2)
    )
    assert (
        e.status == 429 and e.headers() == {"Retry-After": "2"} and e.code == "rate_limit_exceeded"
    )
    e = from_stream_error(
        StreamError(request_id="r", status=400, message="too long", param="prompt")
    )
    assert e.body() == {
        "error": {
            "message": "too long",
            "type": "invalid_request_error",
            "param": "prompt",
            "code": None,
        }
    }
    assert from_stream_error(StreamError(request_id="r", status=200, message="?")).status == 500


# --------------------------------------------------------------------------------- outbound


def spec(api="completion", n=1, logprobs=None, include_usage=False) -> protocol.ResponseSpec:
    return protocol.ResponseSpec(
        api=api,
        request_id="id-1",
        model="m",
        created=123,
        n=n,
        logprobs=logprobs,
        include_usage=include_usage,
    )


def named(token_id: int, logprob: float, rank: int, top: list[tuple[int, float]]) -> TokenLogprobs:
    """Logprobs as the executor sends them: every token named (here "<id>")."""
    return TokenLogprobs(
        token_id=token_id,
        logprob=logprob,
        rank=rank,
        top=top,
        token=f"<{token_id}>",
        top_tokens=[f"<{t}>" for t, _ in top],
    )


def out(*deltas: CompletionDelta, finished=False) -> RequestOutput:
    return RequestOutput(
        request_id="id-1",
        deltas=list(deltas),
        num_prompt_tokens=5,
        num_cached_tokens=2,
        finished=finished,
    )


def d(index, ids, text, finish=None, logprobs=None) -> CompletionDelta:
    return CompletionDelta(
        index=index, token_ids=ids, text=text, finish_reason=finish, logprobs=logprobs
    )


USAGE = {
    "prompt_tokens": 5,
    "completion_tokens": 3,
    "total_tokens": 8,
    "prompt_tokens_details": {"cached_tokens": 2},
}


def test_completion_stream_chunks_and_response_shapes():
    b = protocol.ResponseBuilder(spec(include_usage=True))
    chunks = (
        b.apply(out(d(0, [1], "Hel")))
        + b.apply(out(d(0, [2], "")))
        + b.apply(out(d(0, [3], "lo", "length"), finished=True))
    )
    assert chunks == [
        {
            "id": "id-1",
            "object": "text_completion",
            "created": 123,
            "model": "m",
            "system_fingerprint": None,
            "usage": None,
            "choices": [{"text": "Hel", "index": 0, "logprobs": None, "finish_reason": None}],
        },
        {
            "id": "id-1",
            "object": "text_completion",
            "created": 123,
            "model": "m",
            "system_fingerprint": None,
            "usage": None,
            "choices": [{"text": "lo", "index": 0, "logprobs": None, "finish_reason": "length"}],
        },
    ]  # the held-back step (no text, no finish) sends nothing
    assert b.finished
    assert b.usage_chunk() == {
        "id": "id-1",
        "object": "text_completion",
        "created": 123,
        "model": "m",
        "system_fingerprint": None,
        "choices": [],
        "usage": USAGE,
    }
    assert b.response() == {
        "id": "id-1",
        "object": "text_completion",
        "created": 123,
        "model": "m",
        "system_fingerprint": None,
        "choices": [{"text": "Hello", "index": 0, "logprobs": None, "finish_reason": "length"}],
        "usage": USAGE,
    }


def test_chat_stream_opens_each_choice_with_role_and_interleaves_n():
    b = protocol.ResponseBuilder(spec("chat", n=2))
    chunks = b.apply(out(d(0, [1], "A"), d(1, [2], "B")))
    chunks += b.apply(out(d(1, [3], "", "stop"), d(0, [4], "!", "length"), finished=True))
    base = {
        "id": "id-1",
        "object": "chat.completion.chunk",
        "created": 123,
        "model": "m",
        "system_fingerprint": None,
    }
    assert "usage" not in chunks[0]
    assert chunks == [
        {
            **base,
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
        },
        {
            **base,
            "choices": [
                {
                    "index": 1,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
        },
        {
            **base,
            "choices": [
                {"index": 0, "delta": {"content": "A"}, "logprobs": None, "finish_reason": None}
            ],
        },
        {
            **base,
            "choices": [
                {"index": 1, "delta": {"content": "B"}, "logprobs": None, "finish_reason": None}
            ],
        },
        {**base, "choices": [{"index": 1, "delta": {}, "logprobs": None, "finish_reason": "stop"}]},
        {
            **base,
            "choices": [
                {"index": 0, "delta": {"content": "!"}, "logprobs": None, "finish_reason": "length"}
            ],
        },
    ]
    r = b.response()
    assert r["object"] == "chat.completion" and r["usage"]["completion_tokens"] == 4
    assert r["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "A!", "refusal": None},
            "logprobs": None,
            "finish_reason": "length",
        },
        {
            "index": 1,
            "message": {"role": "assistant", "content": "B", "refusal": None},
            "logprobs": None,
            "finish_reason": "stop",
        },
    ]


def test_completion_logprobs_format():
    lp1 = named(7, -0.5, 1, [(7, -0.5), (8, -1.0)])
    lp2 = named(9, float("-inf"), 3, [(7, -0.1), (8, -0.2)])
    b = protocol.ResponseBuilder(spec(logprobs=2))
    [c1] = b.apply(out(d(0, [7], "<7>", logprobs=[lp1])))
    [c2] = b.apply(out(d(0, [9], "<9>", "length", logprobs=[lp2]), finished=True))
    assert c1["choices"][0]["logprobs"] == {
        "tokens": ["<7>"],
        "token_logprobs": [-0.5],
        "top_logprobs": [{"<7>": -0.5, "<8>": -1.0}],
        "text_offset": [0],
    }
    # the sampled token is added to top_logprobs when it is not among the top N; -inf is clamped
    assert c2["choices"][0]["logprobs"] == {
        "tokens": ["<9>"],
        "token_logprobs": [-9999.0],
        "top_logprobs": [{"<7>": -0.1, "<8>": -0.2, "<9>": -9999.0}],
        "text_offset": [3],
    }
    assert b.response()["choices"][0]["logprobs"] == {
        "tokens": ["<7>", "<9>"],
        "token_logprobs": [-0.5, -9999.0],
        "top_logprobs": [{"<7>": -0.5, "<8>": -1.0}, {"<7>": -0.1, "<8>": -0.2, "<9>": -9999.0}],
        "text_offset": [0, 3],
    }


def test_chat_logprobs_format():
    lp = named(7, -0.5, 1, [(7, -0.5)])
    b = protocol.ResponseBuilder(spec("chat", logprobs=1))
    chunks = b.apply(out(d(0, [7], "<7>", "stop", logprobs=[lp]), finished=True))
    entry = {
        "token": "<7>",
        "logprob": -0.5,
        "bytes": [60, 55, 62],
        "top_logprobs": [{"token": "<7>", "logprob": -0.5, "bytes": [60, 55, 62]}],
    }
    assert chunks[-1]["choices"][0]["logprobs"] == {"content": [entry], "refusal": None}
    assert b.response()["choices"][0]["logprobs"] == {"content": [entry], "refusal": None}
    # logprobs requested but none produced yet: an empty list, not null
    assert protocol.ResponseBuilder(spec("chat", logprobs=0)).response()["choices"][0][
        "logprobs"
    ] == {"content": [], "refusal": None}


def test_unnamed_logprobs_tokens_show_their_ids():
    """An executor that could not name a token: vLLM's return_tokens_as_token_ids format."""
    lp = TokenLogprobs(
        token_id=7,
        logprob=-0.5,
        rank=1,
        top=[(7, -0.5), (8, -1.0)],
        token=None,
        top_tokens=["<7>", None],
    )
    b = protocol.ResponseBuilder(spec(logprobs=2))
    [c] = b.apply(out(d(0, [7], "x", "stop", logprobs=[lp]), finished=True))
    assert c["choices"][0]["logprobs"]["tokens"] == ["token_id:7"]
    assert c["choices"][0]["logprobs"]["top_logprobs"] == [
        {"<7>": -0.5, "token_id:8": -1.0, "token_id:7": -0.5}
    ]


def test_delta_for_a_choice_outside_n_is_a_bug():
    with pytest.raises(ValueError):
        protocol.ResponseBuilder(spec(n=1)).apply(out(d(1, [1], "x")))


def test_only_a_model_404_says_model_not_found():
    """An unknown route is OpenAI's plain "Invalid URL" 404 (no code); a 404 about the model, from
    the gateway's check or a backend's StreamError, keeps ``model_not_found``."""
    route = route_not_found("GET", "/v1/nothing")
    assert (route.status, route.code, route.param) == (404, None, None)
    assert route.body()["error"]["message"] == "Invalid URL (GET /v1/nothing)"
    assert model_not_found("x", "m").code == "model_not_found"
    other = from_stream_error(StreamError(request_id="r", status=404, message="gone"))
    assert other.code is None


@pytest.mark.parametrize(
    "body, param",
    [
        (b'{"model": "m", "prompt": "x", "priority": 18446744073709551616}', "priority"),
        (b'{"model": "m", "prompt": "x", "priority": -2147483648}', "priority"),
        (b'{"model": "m", "prompt": [1, 2147483648]}', "prompt"),
        (b'{"model": "m", "prompt": [[-1]]}', "prompt"),
    ],
)
def test_integers_outside_the_wire_are_400s(body, param):
    with pytest.raises(APIError) as e:
        protocol.completion_to_generate(
            parse_completion_request(body),
            request_id="r",
            limits=LIMITS,
            arrival_time=0,
            deadline=None,
        )
    assert (e.value.status, e.value.param) == (400, param)


def test_split_special_tokens_is_carried_for_raw_prompts():
    for raw, expected in ((b"", False), (b', "split_special_tokens": true', True)):
        req = parse_completion_request(b'{"model": "m", "prompt": "<|im_start|>"' + raw + b"}")
        g = protocol.completion_to_generate(
            req, request_id="r", limits=LIMITS, arrival_time=0, deadline=None
        )
        assert g.split_special_tokens is expected
