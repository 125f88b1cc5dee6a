"""Several models in one stack, the configuration side: ``--model`` / ``--model-name`` paired by
position into ``ServedModel``s (``llmserve up`` and the tokenizer, one rule); ``StackConfig.models``
and the single-model spelling it leaves as it was; what the launcher gives each executor, tokenizer
and the gateway; the gateway's names and the per-model part of its /health. No model, no
servers: every command line is parsed as its process parses it."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import pytest

from services.cli.commands import up
from services.cli.launcher import (
    StackConfig,
    executor_args,
    gateway_model_args,
    served_model_name,
    served_models,
    tokenizer_args,
)
from services.executor.config import SERVED_ENGINE_DEFAULTS
from services.executor.config import parse_config as parse_executor_config
from services.gateway.config import build_parser as gateway_parser
from services.gateway.config import config_from_args as gateway_config
from services.gateway.health import model_health
from services.served_models import DEFAULT_SERVED_MODEL_NAME, ServedModel, pair_models
from services.tokenizer.config import parse_config as parse_tokenizer_config
from shared.engine.config import ENGINE_SETTINGS, EngineConfig, add_engine_arguments
from shared.wire.messages import (
    ExecutorStatus,
    SchedulerStatus,
    TokenizerModelStatus,
    TokenizerStatus,
)


@pytest.fixture(autouse=True)
def no_model_env(monkeypatch):
    for s in ENGINE_SETTINGS:
        monkeypatch.delenv(s.env, raising=False)
    monkeypatch.delenv("LLMSERVE_MODEL_NAME", raising=False)


def up_config(*argv: str) -> StackConfig:
    parser = up.add_parser(argparse.ArgumentParser().add_subparsers())
    return up.stack_config(parser.parse_args(list(argv)))


def hf_dir(tmp_path: Path, name: str, context: int) -> str:
    """A model directory as far as a tokenizer's config reads it: its context length."""
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"max_position_embeddings": context}))
    return str(path)


# -- pairing -----------------------------------------------------------------------------------


def test_models_are_named_after_their_files_or_by_position():
    assert pair_models(["/m/a.gguf", "/m/b dir/"], []) == (
        ServedModel("a", "/m/a.gguf"),
        ServedModel("b-dir", "/m/b dir/"),
    )
    assert pair_models(["/m/a.gguf", "/m/b"], ["x", "y"]) == (
        ServedModel("x", "/m/a.gguf"),
        ServedModel("y", "/m/b"),
    )
    assert pair_models([None], []) == (ServedModel(DEFAULT_SERVED_MODEL_NAME, None),)
    assert pair_models([None], ["smol"]) == (ServedModel("smol", None),)


@pytest.mark.parametrize(
    "paths, names, match",
    [
        (["a.gguf", "b.gguf"], ["x"], r"--model-name was given 1 time\(s\) for 2 model\(s\)"),
        ([None], ["x", "y"], r"given 2 time\(s\) for 1 model"),
        (["/1/m.gguf", "/2/m.gguf"], [], "two models are served as 'm'"),
        (["a.gguf", "b.gguf"], ["x", "x"], "two models are served as 'x'"),
        (["a.gguf"], ["has space"], "without whitespace"),
        (["a.gguf"], [""], "non-empty"),
        ([], [], "no model"),
    ],
)
def test_bad_pairings_are_clear_errors(paths, names, match):
    with pytest.raises(ValueError, match=match):
        pair_models(paths, names)


# -- llmserve up → StackConfig → each process's command line -------------------------------------


def test_up_without_models_serves_the_default_model_as_before():
    config = up_config()
    assert served_models(config) == (ServedModel(DEFAULT_SERVED_MODEL_NAME, None),)
    assert config.engine == SERVED_ENGINE_DEFAULTS
    # The same executor command line as a single-model StackConfig gives (today's spelling).
    assert executor_args(config, 0) == executor_args(StackConfig(), 0)
    assert "--model" not in executor_args(config, 0)
    assert gateway_model_args(config) == ["--model-name", DEFAULT_SERVED_MODEL_NAME]


def test_up_with_one_model_matches_the_single_model_stack_config(monkeypatch):
    config = up_config("--model", "/m/x.gguf", "--model-name", "ex", "--num-kv-blocks", "64")
    old = StackConfig.of(model="/m/x.gguf", model_name="ex", num_kv_blocks=64)
    assert executor_args(config, 0) == executor_args(old, 0)
    assert tokenizer_args(config) == tokenizer_args(old)
    assert served_model_name(config) == served_model_name(old) == "ex"
    monkeypatch.setenv("LLMSERVE_MODEL", "/env/y.gguf")  # the variable names the one model
    assert served_models(up_config()) == (ServedModel("y", "/env/y.gguf"),)
    assert served_models(up_config("--model", "/m/x.gguf")) == (ServedModel("x", "/m/x.gguf"),)


def test_up_with_two_models_starts_executors_of_each_with_unique_ids(tmp_path):
    a, b = hf_dir(tmp_path, "a", 300), hf_dir(tmp_path, "b.v2", 100)
    config = up_config(
        "--model", a, "--model", b, "--model-name", "alpha", "--model-name", "beta.2",
        "--executors", "2", "--max-model-len", "200", "--num-threads", "1",
    )  # fmt: skip
    assert served_models(config) == (ServedModel("alpha", a), ServedModel("beta.2", b))
    assert config.engine.model is None and config.num_executors == 2
    executors = [parse_executor_config(executor_args(config, i)) for i in range(4)]
    assert [(e.executor_id, e.model_name, e.engine.model) for e in executors] == [
        ("executor-0", "alpha", a),
        ("executor-1", "alpha", a),
        ("executor-2", "beta.2", b),
        ("executor-3", "beta.2", b),
    ]
    assert all(e.engine == replace(config.engine, model=e.engine.model) for e in executors)
    with pytest.raises(ValueError, match="executor index 4 out of range for 2 model"):
        executor_args(config, 4)

    # The tokenizer serves both, each capped by its own context as the engine caps it.
    tokenizer = parse_tokenizer_config(["--nats-url", "nats://h:1", *tokenizer_args(config)])
    assert [(m.name, m.path, m.limits.max_model_len) for m in tokenizer.models] == [
        ("alpha", a, 200),
        ("beta.2", b, 100),
    ]
    args = gateway_parser().parse_args(gateway_model_args(config))
    assert gateway_config(args).model_names == ("alpha", "beta.2")


def test_the_cores_are_divided_among_every_models_executors(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    two = StackConfig(models=(ServedModel("a", "/a"), ServedModel("b", "/b")), num_executors=2)
    assert parse_executor_config(executor_args(two, 3)).engine.num_threads == 2
    assert parse_executor_config(executor_args(StackConfig(), 0)).engine.num_threads == 8


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--model", "a.gguf", "--model", "b.gguf", "--model-name", "x"], "once per --model"),
        (["--model", "/1/m.gguf", "--model", "/2/m.gguf"], "give each its own --model-name"),
    ],
)
def test_up_rejects_bad_model_flags(argv, match):
    with pytest.raises(ValueError, match=match):
        up_config(*argv)


def test_stack_config_takes_models_one_way_only():
    with pytest.raises(ValueError, match="not both"):
        StackConfig(models=(ServedModel("a", "/a"),), model_name="b")
    with pytest.raises(ValueError, match="not both"):
        StackConfig.of(models=(ServedModel("a", "/a"),), model="/b")
    with pytest.raises(ValueError, match="every model needs its path"):
        StackConfig(models=(ServedModel("a", None), ServedModel("b", "/b")))
    with pytest.raises(ValueError, match="two models are served as 'a'"):
        StackConfig(models=(ServedModel("a", "/a"), ServedModel("a", "/b")))
    # The single-model keywords keep meaning what they meant.
    config = StackConfig.of(model="/m/tiny", num_kv_blocks=8)
    assert served_models(config) == (ServedModel("tiny", "/m/tiny"),)
    assert config.engine == replace(SERVED_ENGINE_DEFAULTS, model="/m/tiny", num_kv_blocks=8)


def test_the_tokenizer_alone_serves_the_default_model_under_its_name(tmp_path, monkeypatch):
    path = hf_dir(tmp_path, "solo", 64)
    monkeypatch.setenv("LLMSERVE_MODEL", path)
    [model] = parse_tokenizer_config([]).models
    assert (model.name, model.path, model.limits.max_model_len) == ("solo", path, 64)
    # The executor names it the same way, so a stack started by hand agrees without names...
    assert parse_executor_config([]).model_name == "solo"
    # ...and both read the one variable that names it.
    monkeypatch.setenv("LLMSERVE_MODEL_NAME", "named")
    assert [m.name for m in parse_tokenizer_config([]).models] == ["named"]
    assert parse_executor_config([]).model_name == "named"


def test_engine_flags_can_be_repeatable_for_a_command_that_reads_them_itself():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser, repeatable=("model",))
    args = parser.parse_args(["--model", "a", "--model", "b", "--max-num-seqs", "3"])
    assert args.model == ["a", "b"]
    assert EngineConfig.from_args(args, exclude=("model",)) == EngineConfig(max_num_seqs=3)
    with pytest.raises(ValueError, match="not engine settings: nope"):
        add_engine_arguments(argparse.ArgumentParser(), repeatable=("nope",))


# -- the gateway -----------------------------------------------------------------------------------


def test_gateway_model_names_from_flags_or_environment(monkeypatch):
    assert gateway_config(gateway_parser().parse_args([])).model_names == ()
    monkeypatch.setenv("LLMSERVE_MODEL_NAME", "a, b")
    assert gateway_config(gateway_parser().parse_args([])).model_names == ("a", "b")
    args = gateway_parser().parse_args(["--model-name", "c"])
    assert gateway_config(args).model_names == ("c",)  # a flag beats the variable
    with pytest.raises(ValueError, match="distinct"):
        gateway_config(gateway_parser().parse_args(["--model-name", "c", "--model-name", "c"]))


def test_health_names_each_models_executors_and_context():
    def executor(i: int, model: str) -> ExecutorStatus:
        return ExecutorStatus(
            executor_id=f"executor-{i}",
            model=model,
            num_free_blocks=1,
            num_total_blocks=2,
            num_running=0,
            num_waiting=0,
            num_in_flight=0,
            last_heartbeat_age_s=0.1,
        )

    scheduler = SchedulerStatus(
        executors=[executor(0, "a"), executor(1, "a"), executor(2, "stray")],
        num_queued=0,
        max_queue_len=4,
    )
    tokenizer = TokenizerStatus(
        models=[
            TokenizerModelStatus(name="a", max_model_len=64, block_size=16),
            TokenizerModelStatus(name="b", max_model_len=32, block_size=16),
        ]
    )
    assert model_health(("a", "b"), scheduler, tokenizer) == {
        "a": {"num_executors": 2, "max_model_len": 64},
        "b": {"num_executors": 0, "max_model_len": 32},  # still loading: not ready yet
        "stray": {"num_executors": 1, "max_model_len": None},  # no tokenizer serves it
    }
