"""Secrets in configuration, without servers: the API key and the passwords come from the
environment or a file and never from a flag; the printed curl shows a placeholder, not the key;
every subject is granted in shared/wire/permissions.py; the generated credentials give each kind
its own secret and print none."""

from __future__ import annotations

import argparse
import inspect

import pytest

from services.cli.commands import up
from services.cli.credentials import StackCredentials
from services.connections import (
    RedisAuth,
    add_nats_auth_arguments,
    add_redis_auth_arguments,
    nats_auth_from_args,
    redis_auth_from_args,
)
from services.gateway.config import build_parser, config_from_args
from shared.engine.config import ENGINE_SETTINGS
from shared.wire import subjects
from shared.wire.bus_auth import BusAuth, redact_url
from shared.wire.permissions import ADMIN_USER, PERMISSIONS, SERVICE_KINDS

SECRET_ENV = ("LLMSERVE_API_KEY", "LLMSERVE_API_KEY_FILE", "NATS_USER", "NATS_PASSWORD")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in (*SECRET_ENV, "NATS_PASSWORD_FILE", "REDIS_USERNAME", "REDIS_PASSWORD"):
        monkeypatch.delenv(name, raising=False)
    for s in ENGINE_SETTINGS:
        monkeypatch.delenv(s.env, raising=False)


def up_parser() -> argparse.ArgumentParser:
    return up.add_parser(argparse.ArgumentParser().add_subparsers())


def test_an_api_key_on_the_command_line_is_refused_with_the_way_to_give_it(capsys):
    for parser in (up_parser(), build_parser()):
        with pytest.raises(SystemExit) as exit:
            parser.parse_args(["--api-key", "sekret"])
        assert exit.value.code == 2
        err = capsys.readouterr().err
        assert "`ps`" in err and "LLMSERVE_API_KEY" in err and "--api-key-file" in err
        assert "sekret" not in err


def test_the_api_key_comes_from_the_environment_or_a_file(monkeypatch, tmp_path):
    assert up.stack_config(up_parser().parse_args([])).api_key is None
    monkeypatch.setenv("LLMSERVE_API_KEY", "from-env")
    assert up.stack_config(up_parser().parse_args([])).api_key == "from-env"
    assert config_from_args(build_parser().parse_args([])).api_key == "from-env"
    key_file = tmp_path / "key"
    key_file.write_text("from-file\nignored second line\n")
    key_file.chmod(0o600)
    args = ["--api-key-file", str(key_file)]
    assert up.stack_config(up_parser().parse_args(args)).api_key == "from-file"  # beats the env
    gateway = config_from_args(build_parser().parse_args(args))
    assert gateway.api_key == "from-file" and "from-file" not in repr(gateway)
    key_file.write_text("\n")
    with pytest.raises(ValueError, match=r"API key file .* is empty"):
        up.stack_config(up_parser().parse_args(args))
    with pytest.raises(ValueError, match="cannot read the API key"):
        up.stack_config(up_parser().parse_args(["--api-key-file", str(tmp_path / "none")]))


def test_the_printed_curl_never_shows_the_key():
    curl = up._curl_example("http://h:1", "m", None, with_key=True)
    assert '-H "Authorization: Bearer $LLMSERVE_API_KEY"' in curl
    from_file = up._curl_example("http://h:1", "m", "/keys/my key", with_key=True)
    assert from_file.startswith("export LLMSERVE_API_KEY=\"$(head -n 1 '/keys/my key')\"\n")
    assert "Authorization" not in up._curl_example("http://h:1", "m", None, with_key=False)


def test_passwords_come_from_the_environment_or_a_file_never_a_flag(monkeypatch, tmp_path, capsys):
    def parser() -> argparse.ArgumentParser:  # a flag's default is read from the environment
        p = argparse.ArgumentParser()
        add_nats_auth_arguments(p)
        add_redis_auth_arguments(p)
        return p

    p = parser()
    for flag in ("--nats-password", "--redis-password", "--nats-pass"):
        with pytest.raises(SystemExit):
            p.parse_args([flag, "s3cr3t-value"])
        err = capsys.readouterr().err
        # Refused by name, or as ambiguous; never taken for a file's path (and printed).
        assert ("`ps`" in err or "ambiguous" in err) and "s3cr3t-value" not in err
    assert nats_auth_from_args(p.parse_args([])) == BusAuth()
    monkeypatch.setenv("NATS_USER", "tokenizer")
    monkeypatch.setenv("NATS_PASSWORD", "pw-env")
    p = parser()
    assert nats_auth_from_args(p.parse_args([])) == BusAuth(user="tokenizer", password="pw-env")
    secret = tmp_path / "pw"
    secret.write_text("pw-file\n")
    auth = nats_auth_from_args(p.parse_args(["--nats-password-file", str(secret)]))
    assert auth.password == "pw-file" and "pw-file" not in repr(auth)
    assert auth.inbox_prefix == "_INBOX.tokenizer"
    monkeypatch.setenv("REDIS_USERNAME", "prefix_index")
    monkeypatch.setenv("REDIS_PASSWORD", "r-pw")
    p = parser()
    redis = redis_auth_from_args(p.parse_args(["--redis-tls-ca", "ca.pem"]))
    assert redis.client_options() == {
        "username": "prefix_index",
        "password": "r-pw",
        "ssl_ca_certs": "ca.pem",
    }
    assert "r-pw" not in repr(redis)
    with pytest.raises(ValueError, match="REDIS_PASSWORD"):
        RedisAuth(username="prefix_index")


def test_every_subject_is_granted_to_a_sender_and_a_receiver():
    """A subject added to subjects.py that no kind may use fails here: grant it in
    permissions.py (the KV events are read through their JetStream consumer, not a
    subscription)."""
    concrete = {
        v
        for k, v in vars(subjects).items()
        if k.isupper() and isinstance(v, str) and v.startswith(subjects.PREFIX + ".")
    } | {
        f("x")
        for name, f in inspect.getmembers(subjects, inspect.isfunction)
        if not name.startswith("_")
        and f.__module__ == subjects.__name__
        and len(inspect.signature(f).parameters) == 1
    }
    concrete = {s for s in concrete if "*" not in s and ">" not in s}

    def granted(patterns: tuple[str, ...], subject: str) -> bool:
        tokens = subject.split(".")
        return any(
            len(p.split(".")) == len(tokens)
            and all(a in ("*", b) for a, b in zip(p.split("."), tokens, strict=True))
            for p in patterns
        )

    services = [PERMISSIONS[k] for k in SERVICE_KINDS]
    for subject in sorted(concrete):
        assert any(granted(p.publish, subject) for p in services), f"nobody publishes {subject}"
        if subject != subjects.kv_events("x"):
            assert any(granted(p.subscribe, subject) for p in services), f"nobody reads {subject}"
    assert set(PERMISSIONS) == {*SERVICE_KINDS, ADMIN_USER}
    # Every kind publishes its own metrics reports (and no other kind's); gateways read them all.
    for kind in SERVICE_KINDS:
        subject = subjects.metrics(kind, "x")
        assert [k for k in SERVICE_KINDS if granted(PERMISSIONS[k].publish, subject)] == [kind]
        assert granted(PERMISSIONS["gateway"].subscribe, subject)


def test_the_credentials_give_each_kind_its_own_secret_and_print_none():
    creds = StackCredentials.generate()
    passwords = creds.secrets()
    assert len(set(passwords)) == len(passwords) == len(PERMISSIONS) + 2  # + 2 Redis users
    assert all(len(p) >= 40 for p in passwords)
    assert not any(p in repr(creds) for p in passwords)
    assert creds.nats_env("tokenizer") == {
        "NATS_USER": "tokenizer",
        "NATS_PASSWORD": creds.nats_passwords["tokenizer"],
    }
    assert creds.redis_env("tokenizer") == {}
    assert creds.redis_env("prefix_index")["REDIS_PASSWORD"] == creds.redis_password
    with pytest.raises(ValueError, match="unknown service kind"):
        creds.nats_env(ADMIN_USER)  # no service runs as the admin
    config = creds.nats_authorization()
    assert config.count("user: ") == len(PERMISSIONS)
    assert '"$JS.API.STREAM.INFO.LLMSERVE_KV_EVENTS"' in config  # quoted: '$' stays literal
    acl = creds.redis_acl()
    assert acl.startswith("user default off\n") and "~{llmserve:pi}:*" in acl
    assert "user gateway on" in acl and "~llmserve:gw:*" in acl
    assert creds.redis_env("gateway")["REDIS_PASSWORD"] == creds.redis_gateway_password


def test_urls_are_printed_without_their_password():
    assert redact_url("nats://u:secret@host:4222") == "nats://u:***@host:4222"
    assert redact_url("redis://:secret@h/0") == "redis://:***@h/0"
    assert redact_url("nats://127.0.0.1:4222") == "nats://127.0.0.1:4222"
