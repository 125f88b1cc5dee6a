"""The keys file and what a request costs (services/gateway/api_keys.py): pure, no servers."""

from __future__ import annotations

import argparse

import pytest

from services.gateway.api_keys import (
    BYTES_PER_TOKEN,
    ApiKey,
    KeyRing,
    parse_api_keys,
    reserved_tokens,
)
from services.gateway.config import GatewayConfig, build_parser, config_from_args
from services.gateway.limiter import rate_limited
from shared.wire.messages import ChatMessage, GenerateRequest
from shared.wire.sampling_params import SamplingParams

SECRET = "sk-very-secret-4711"


def test_a_keys_file_parses_with_comments_blank_lines_and_optional_limits():
    text = f"""
# team keys
{{"key": "{SECRET}", "name": "team-a", "requests_per_minute": 60, \
"tokens_per_minute": 20000, "max_concurrent": 4}}

{{"key": "sk-b", "name": "team-b", "requests_per_minute": null}}
"""
    a, b = parse_api_keys(text)
    assert (a.name, a.requests_per_minute, a.tokens_per_minute, a.max_concurrent) == (
        "team-a",
        60,
        20000,
        4,
    )
    assert a.limited and not b.limited
    assert SECRET not in repr(a)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "line 2: not a JSON object"),
        ('["a"]', "line 2: expected a JSON object, got list"),
        ('{"name": "x"}', "line 2: 'key' must be a string"),
        (f'{{"key": "{SECRET}"}}', "line 2: 'name' must be a string"),
        (f'{{"key": "{SECRET}", "name": "x", "rpm": 5}}', r"line 2: unknown field\(s\) \['rpm'\]"),
        (
            f'{{"key": "{SECRET}", "name": "x", "max_concurrent": 0}}',
            "max_concurrent must be a positive",
        ),
        (
            f'{{"key": "{SECRET}", "name": "x", "tokens_per_minute": 1.5}}',
            "tokens_per_minute must be",
        ),
        (
            f'{{"key": "{SECRET}", "name": "x", "requests_per_minute": true}}',
            "requests_per_minute must",
        ),
        (f'{{"key": "{SECRET}", "name": "a b"}}', "name must be"),
        ('{"key": "has space", "name": "x"}', "without whitespace"),
        (f'{{"key": "{SECRET}", "name": "first"}}', "the name 'first' is given twice"),
        ('{"key": "sk-first", "name": "y"}', "key 'y' is the same key as an earlier one"),
    ],
)
def test_a_bad_line_is_named_with_what_is_wrong_and_never_the_key(line, message):
    text = '{"key": "sk-first", "name": "first"}\n' + line
    with pytest.raises(ValueError, match=message) as e:
        parse_api_keys(text, "keys.jsonl")
    assert SECRET not in str(e.value) and "sk-first" not in str(e.value)


def test_an_empty_file_is_an_error():
    with pytest.raises(ValueError, match="holds no key"):
        parse_api_keys("# nothing\n\n")


def test_the_keyring_finds_a_key_by_its_exact_text():
    ring = KeyRing([ApiKey(name="a", key="sk-a"), ApiKey(name="b", key="sk-b")])
    assert ring.find("sk-a").name == "a"  # type: ignore[union-attr]
    assert ring.find("sk-a ") is None and ring.find("sk-") is None and ring.find("") is None


def _request(**kw) -> GenerateRequest:
    params = SamplingParams(max_tokens=kw.pop("max_tokens", 16), n=kw.pop("n", 1))
    return GenerateRequest(request_id="r", model="m", params=params, **kw)


def test_reserved_tokens_are_the_prompt_estimate_plus_max_tokens_times_n():
    assert reserved_tokens(_request(prompt="x" * 40, max_tokens=10)) == 40 // BYTES_PER_TOKEN + 10
    assert reserved_tokens(_request(prompt="x" * 41, max_tokens=10, n=2)) == 11 + 20
    assert reserved_tokens(_request(prompt_token_ids=[1, 2, 3], max_tokens=5)) == 8
    chat = [ChatMessage(role="user", content="é" * 4)]  # 8 UTF-8 bytes
    assert reserved_tokens(_request(messages=chat, max_tokens=None)) == 2 + 1024


def test_a_429_names_the_limit_and_retries_after_the_refill_rounded_up():
    key = ApiKey(name="team-a", key=SECRET, requests_per_minute=4)
    e = rate_limited(key, "requests_per_minute", 14_200)
    assert e.status == 429 and e.param == "requests_per_minute"
    assert "requests_per_minute" in e.message and "team-a" in e.message
    assert SECRET not in e.message
    assert e.headers() == {"Retry-After": "15"}


def test_config_reads_the_keys_file_and_needs_redis_for_limits(tmp_path, monkeypatch):
    monkeypatch.delenv("REDIS_URL", raising=False)
    path = tmp_path / "keys.jsonl"
    path.write_text(f'{{"key": "{SECRET}", "name": "a", "max_concurrent": 2}}\n')
    args = ["--api-keys-file", str(path)]
    with pytest.raises(ValueError, match="need Redis"):
        config_from_args(build_parser().parse_args(args))
    config = config_from_args(
        build_parser().parse_args([*args, "--redis-url", "redis://127.0.0.1:1/0"])
    )
    assert config.api_keys[0].max_concurrent == 2 and SECRET not in repr(config)
    missing = build_parser().parse_args(["--api-keys-file", str(tmp_path / "nope")])
    with pytest.raises(ValueError, match="cannot read the API keys file"):
        config_from_args(missing)
    with pytest.raises(ValueError, match="named 'default'"):
        GatewayConfig(api_key="k", api_keys=(ApiKey(name="default", key="other"),))
    assert isinstance(build_parser(), argparse.ArgumentParser)
