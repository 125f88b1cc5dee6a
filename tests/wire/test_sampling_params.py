import math

import msgspec
import pytest

from shared.wire.sampling_params import SamplingParams, decode_sampling_params


def test_defaults_are_valid_and_match_openai():
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (
        1,
        16,
        1.0,
        1.0,
        0,
        0.0,
    )
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.seed is None and p.logprobs is None and p.stop == [] and p.stop_token_ids == []
    assert p.skip_special_tokens and not p.ignore_eos and not p.include_stop_str_in_output
    assert not p.is_greedy and not p.uses_penalties


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_tokens=None),
        dict(max_tokens=1),
        dict(temperature=0),
        dict(top_k=-1),
        dict(top_k=5),
        dict(top_p=1e-9),
        dict(min_p=1.0),
        dict(presence_penalty=-2.0),
        dict(frequency_penalty=2),
        dict(n=128),
        dict(logprobs=0),
        dict(logprobs=20),
        dict(seed=-1),
        dict(seed=2**64 - 1),
        dict(stop=["\n", "END"], stop_token_ids=[0, 2]),
        dict(max_tokens=2**31 - 1, top_k=2**31 - 1, stop_token_ids=[2**31 - 1] * 1024),
        dict(stop=["s" * 1024] * 32),
    ],
)
def test_valid_edge_values_pass(kwargs):
    SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("max_tokens", 1.5),
        ("max_tokens", True),
        ("max_tokens", 2.0),
        ("n", 0),
        ("n", 129),
        ("n", True),
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", True),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", -0.5),
        ("top_k", -2),
        ("top_k", 1.5),
        ("top_k", False),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("frequency_penalty", 3.0),
        ("frequency_penalty", -2.5),
        ("logprobs", -1),
        ("logprobs", 21),
        ("logprobs", 1.0),
        ("seed", 2**64),
        ("seed", 1.5),
        ("stop", [""]),
        ("stop", "x"),
        ("stop", [1]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [1.0]),
        ("stop_token_ids", [True]),
        ("ignore_eos", 1),
        ("skip_special_tokens", "yes"),
        # Every integer is bounded (issue 21: 2**64 once became a 500 at msgpack encoding).
        ("max_tokens", 2**31),
        ("max_tokens", 2**64),
        ("top_k", 2**64),
        ("stop_token_ids", [2**31]),
        ("stop_token_ids", [2**70]),
        ("n", 2**64),
        ("logprobs", 2**64),
        ("seed", -(2**63) - 1),
        # Stop lists are bounded in count and length; the message stays short.
        ("stop", ["s"] * 33),
        ("stop", ["s" * 1025]),
        ("stop_token_ids", [1] * 1025),
    ],
)
def test_bad_value_raises_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict({field: value})


@pytest.mark.parametrize("data", [{"foo": 1}, b'{"foo": 1}', '{"max_tokens": 4, "foo": 1}'])
def test_unknown_fields_are_rejected(data):
    with pytest.raises(ValueError, match="unknown field 'foo'"):
        decode_sampling_params(data)


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(ValueError, match="unknown field 'best_of'"):
        SamplingParams.from_dict({"best_of": 2})


@pytest.mark.parametrize(
    "data,field",
    [
        (b'{"max_tokens": 1.5}', "max_tokens"),
        (b'{"max_tokens": "3"}', "max_tokens"),
        (b'{"temperature": "hot"}', "temperature"),
        (b'{"stop": [1]}', "stop"),
        (b'{"max_tokens": 0}', "max_tokens"),
        (b'{"top_p": 0}', "top_p"),
    ],
)
def test_decode_errors_name_the_field(data, field):
    with pytest.raises(ValueError, match=field) as info:
        decode_sampling_params(data)
    assert type(info.value) is ValueError  # not msgspec's subclass: callers see one error type
    with pytest.raises(ValueError, match=field):
        decode_sampling_params(msgspec.json.decode(data))


def test_malformed_json_is_a_value_error():
    with pytest.raises(ValueError, match="invalid"):
        decode_sampling_params(b'{"max_tokens": ')


def test_decode_fills_defaults_and_normalises_numbers():
    p = decode_sampling_params(b'{"temperature": 0, "top_k": 3, "stop": ["x"]}')
    assert p.is_greedy and p.top_k == 3 and p.stop == ["x"] and p.max_tokens == 16
    assert type(SamplingParams(temperature=1).temperature) is float


def test_wire_round_trip_and_frozen():
    p = SamplingParams(
        n=2,
        max_tokens=None,
        temperature=0.7,
        top_k=40,
        seed=7,
        stop=["a"],
        stop_token_ids=[2],
        logprobs=5,
        repetition_penalty=1.2,
    )
    assert msgspec.json.decode(msgspec.json.encode(p), type=SamplingParams) == p
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams) == p
    with pytest.raises(AttributeError):
        p.temperature = 0.0  # type: ignore[misc]


def test_errors_quote_huge_values_briefly():
    with pytest.raises(ValueError) as e:
        SamplingParams(stop=["x" * 10**6])
    assert len(str(e.value)) < 200
    with pytest.raises(ValueError) as e:
        SamplingParams(max_tokens=10**5000)
    assert len(str(e.value)) < 200 and "max_tokens" in str(e.value)
