"""The engine settings, declared once in ``shared.engine.config``: every command line that takes
them (``llmserve up``, ``llmserve generate``, the executor, the tokenizer's subset) shows each with
its help; a config survives the argv the launcher writes; a flag beats its environment variable,
which beats the command's default. Torch-free: none of this imports torch."""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from services.cli.commands import generate, up
from services.cli.launcher import StackConfig, executor_args, tokenizer_args
from services.executor.config import SERVED_ENGINE_DEFAULTS
from services.executor.config import build_parser as executor_parser
from services.executor.config import parse_config as parse_executor_config
from services.runtime import env_value
from services.tokenizer.config import TOKENIZER_ENGINE_SETTINGS
from services.tokenizer.config import build_parser as tokenizer_parser
from shared.engine.config import ENGINE_SETTINGS, WEIGHT_DTYPES, EngineConfig, settings

ROOT = Path(__file__).resolve().parents[2]

# The environment variables the commands read before the settings were declared once: unchanged.
KNOWN_ENV = {
    "model": "LLMSERVE_MODEL",
    "dtype": "LLMSERVE_DTYPE",
    "device": "LLMSERVE_DEVICE",
    "block_size": "LLMSERVE_BLOCK_SIZE",
    "memory_budget": "LLMSERVE_MEMORY_BUDGET",
    "num_kv_blocks": "LLMSERVE_NUM_KV_BLOCKS",
    "max_num_seqs": "LLMSERVE_MAX_NUM_SEQS",
    "max_num_batched_tokens": "LLMSERVE_MAX_NUM_BATCHED_TOKENS",
    "max_model_len": "LLMSERVE_MAX_MODEL_LEN",
    "num_threads": "LLMSERVE_NUM_THREADS",
    "quantization": "LLMSERVE_QUANTIZATION",
    "kv_cache_dtype": "LLMSERVE_KV_CACHE_DTYPE",
}

EXAMPLES = [
    EngineConfig(),
    SERVED_ENGINE_DEFAULTS,
    EngineConfig(
        model="/models/x.gguf",
        dtype="float32",
        device="cpu",
        block_size=32,
        memory_budget="512MiB",
        num_kv_blocks=9,
        max_num_batched_tokens=64,
        max_num_seqs=3,
        long_prefill_token_threshold=32,
        prefill_slice_ms=5,
        max_model_len=100,
        num_threads=2,
        seed=7,
        quantization="int8",
        kv_cache_dtype="int8",
    ),
]


@pytest.fixture(autouse=True)
def no_engine_env(monkeypatch):
    for s in ENGINE_SETTINGS:
        monkeypatch.delenv(s.env, raising=False)


def command_parser(module) -> argparse.ArgumentParser:
    subparsers = argparse.ArgumentParser().add_subparsers()
    return module.add_parser(subparsers)


def engine_flags(parser: argparse.ArgumentParser) -> dict[str, str]:
    """flag -> help of the parser's engine-settings group ("" for a flag without help)."""
    group = next(g for g in parser._action_groups if g.title == "engine settings")
    return {a.option_strings[0]: a.help or "" for a in group._group_actions}


def test_env_names_are_the_ones_commands_read_before():
    assert {s.name: s.env for s in ENGINE_SETTINGS if s.name in KNOWN_ENV} == KNOWN_ENV


@pytest.mark.parametrize("command", ["up", "generate", "executor"])
def test_every_setting_is_on_every_engine_command_line_with_help(command):
    parser = {
        "up": lambda: command_parser(up),
        "generate": lambda: command_parser(generate),
        "executor": executor_parser,
    }[command]()
    flags = engine_flags(parser)
    expected = {
        s.flag for s in settings(exclude=generate.ENGINE_EXCLUDED if command == "generate" else ())
    }
    assert set(flags) == expected
    for s in settings():
        if s.flag in flags:
            assert s.env in flags[s.flag] and len(flags[s.flag]) > len(s.env) + 10


def test_the_served_commands_default_to_a_2gib_budget_and_generate_to_the_engines():
    assert EngineConfig().memory_budget == "1GiB"
    assert "(default: 2GiB)" in engine_flags(command_parser(up))["--memory-budget"]
    assert "(default: 1GiB)" in engine_flags(command_parser(generate))["--memory-budget"]
    assert parse_executor_config([]).engine == SERVED_ENGINE_DEFAULTS
    assert StackConfig().engine == SERVED_ENGINE_DEFAULTS


@pytest.mark.parametrize("config", EXAMPLES)
def test_argv_round_trip(config):
    assert EngineConfig.from_argv(config.to_argv(), base=EngineConfig()) == config
    assert EngineConfig.from_argv(config.to_argv(), base=SERVED_ENGINE_DEFAULTS) == config


def test_a_flag_beats_its_variable_which_beats_the_default(monkeypatch):
    assert parse_executor_config([]).engine.max_num_seqs == 64
    monkeypatch.setenv("LLMSERVE_MAX_NUM_SEQS", "8")
    monkeypatch.setenv("LLMSERVE_MEMORY_BUDGET", "")  # empty: unset
    assert parse_executor_config([]).engine.max_num_seqs == 8
    assert parse_executor_config([]).engine.memory_budget == "2GiB"
    assert parse_executor_config(["--max-num-seqs", "4"]).engine.max_num_seqs == 4
    monkeypatch.setenv("LLMSERVE_NUM_KV_BLOCKS", "lots")
    with pytest.raises(SystemExit, match="LLMSERVE_NUM_KV_BLOCKS must be an integer, got 'lots'"):
        parse_executor_config([])


def test_up_reads_the_engine_settings_from_flags_and_environment(monkeypatch):
    monkeypatch.setenv("LLMSERVE_DTYPE", "float32")
    args = command_parser(up).parse_args(["--max-num-seqs", "3", "--num-kv-blocks", "40"])
    engine = EngineConfig.from_args(args, EngineConfig.from_env(env_value, SERVED_ENGINE_DEFAULTS))
    assert engine == replace(
        SERVED_ENGINE_DEFAULTS, dtype="float32", max_num_seqs=3, num_kv_blocks=40
    )


def test_the_launcher_gives_each_executor_the_whole_engine_config():
    engine = replace(SERVED_ENGINE_DEFAULTS, dtype="float32", num_kv_blocks=64, quantization="int8")
    config = StackConfig(engine=engine, num_executors=2)
    executor = parse_executor_config(["--nats-url", "nats://h:1", *executor_args(config, 1)])
    assert executor.executor_id == "executor-1"
    assert executor.engine == replace(engine, num_threads=executor.engine.num_threads)
    assert executor.engine.num_threads is not None
    assert executor.engine.num_threads >= 1  # the cores divided among the executors
    # The tokenizer gets the model (path and served name) and the limits settings, nothing else.
    args = tokenizer_parser().parse_args(
        tokenizer_args(StackConfig(engine=replace(engine, model="m.gguf", max_model_len=99)))
    )
    assert (args.model, args.model_name) == (["m.gguf"], ["m"])
    assert EngineConfig.from_args(args, exclude=("model",)) == EngineConfig(max_model_len=99)
    assert {a for a in tokenizer_args(config) if a.startswith("--")} == {"--model-name"} | {
        s.flag for s in settings(TOKENIZER_ENGINE_SETTINGS) if getattr(engine, s.name) is not None
    }


def test_stack_config_of_splits_engine_and_stack_keywords():
    config = StackConfig.of(port=0, num_kv_blocks=128, max_queue_len=4)
    assert (config.port, config.max_queue_len) == (0, 4)
    assert config.engine == replace(SERVED_ENGINE_DEFAULTS, num_kv_blocks=128)


def test_engine_config_is_validated_without_torch():
    with pytest.raises(ValueError, match="unsupported dtype 'int4'"):
        EngineConfig(dtype="int4")
    with pytest.raises(ValueError, match="num_threads must be positive"):
        EngineConfig(num_threads=0)
    with pytest.raises(ValueError, match="not engine settings: nope"):
        settings(include=("nope",))
    code = (
        "import sys; from shared.engine.config import EngineConfig; "
        "from services.cli.main import build_parser; "
        "build_parser(); EngineConfig(dtype='float32'); "
        "print([m for m in sys.modules if m.split('.')[0] in ('torch', 'kernels')])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(long_prefill_token_threshold=0), "long_prefill_token_threshold must be > 0"),
        (dict(long_prefill_chunk_tokens=0), "long_prefill_chunk_tokens must be > 0"),
        (dict(prefill_slice_ms=-1), "prefill_slice_ms cannot be negative"),
    ],
)
def test_long_prefill_settings_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_long_prefill_settings_reach_the_executor_command_line(monkeypatch):
    monkeypatch.setenv("LLMSERVE_PREFILL_SLICE_MS", "40")
    config = parse_executor_config(
        ["--long-prefill-token-threshold", "96", "--long-prefill-chunk-tokens", "32"]
    ).engine
    assert (config.long_prefill_token_threshold, config.prefill_slice_ms) == (96, 40)
    assert config.long_prefill_chunk_tokens == 32


def test_weight_dtypes_are_the_loaders():
    from shared.engine.models.loader import DTYPES

    assert set(DTYPES) == set(WEIGHT_DTYPES)


@pytest.mark.parametrize(
    "text,value", [("1", True), ("Yes", True), ("on", True), ("0", False), ("OFF", False)]
)
def test_env_value_reads_booleans(monkeypatch, text, value):
    monkeypatch.setenv("LLMSERVE_TEST_FLAG", text)
    assert env_value("LLMSERVE_TEST_FLAG", bool) is value


def test_env_value_names_a_bad_variable(monkeypatch):
    assert env_value("LLMSERVE_TEST_UNSET", int) is None
    monkeypatch.setenv("LLMSERVE_TEST_FLAG", "maybe")
    with pytest.raises(
        SystemExit, match="LLMSERVE_TEST_FLAG must be one of 1/true/yes/on/0/false/no/off"
    ):
        env_value("LLMSERVE_TEST_FLAG", bool)


def test_prefix_caching_can_be_turned_off_on_every_command_line(monkeypatch):
    """A setting added by its declaration alone (enable_prefix_caching) is on every command line,
    read from its variable, and in the argv the launcher gives the executors."""
    for parser in (command_parser(up), command_parser(generate), executor_parser()):
        flags = engine_flags(parser)
        assert (
            "--enable-prefix-caching" in flags
            and "LLMSERVE_ENABLE_PREFIX_CACHING" in flags["--enable-prefix-caching"]
        )
    args = command_parser(generate).parse_args(["hi", "--no-enable-prefix-caching"])
    assert EngineConfig.from_args(args).enable_prefix_caching is False
    assert parse_executor_config([]).engine.enable_prefix_caching is True
    monkeypatch.setenv("LLMSERVE_ENABLE_PREFIX_CACHING", "0")
    assert parse_executor_config([]).engine.enable_prefix_caching is False
    assert parse_executor_config(["--enable-prefix-caching"]).engine.enable_prefix_caching is True
    config = StackConfig.of(enable_prefix_caching=False)
    assert "--no-enable-prefix-caching" in executor_args(config, 0)
    assert parse_executor_config(executor_args(config, 0)).engine.enable_prefix_caching is False


def test_generate_keeps_the_engine_seed_apart_from_the_sampling_seed(monkeypatch):
    """generate's --seed is each request's (SamplingParams.seed); the engine's global seed keeps
    its default, also when --seed is not given (None must not reach EngineConfig.seed)."""
    import types

    class Stop(Exception):
        pass

    seen: list[EngineConfig] = []

    def fake_llm(config: EngineConfig):
        seen.append(config)
        raise Stop

    monkeypatch.delenv("LLMSERVE_SEED", raising=False)
    monkeypatch.setitem(sys.modules, "shared.engine.llm", types.SimpleNamespace(LLM=fake_llm))
    for argv in (["hi"], ["hi", "--seed", "7", "--kv-cache-dtype", "fp8"]):
        with pytest.raises(Stop):
            generate.run(command_parser(generate).parse_args(argv))
    assert [c.seed for c in seen] == [EngineConfig().seed] * 2
    assert [c.kv_cache_dtype for c in seen] == ["auto", "fp8"]
