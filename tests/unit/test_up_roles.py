"""``llmserve up --prefill N --decode M --executor-cpus``: each executor's role and cores on its
command line, and the CPU list syntax."""

from __future__ import annotations

import argparse

import pytest

from services.cli.commands.up import add_parser, stack_config
from services.cli.launcher import executor_args, scheduler_args
from services.executor.config import parse_cpu_list
from services.scheduler.config import parse_config as parse_scheduler_config


def build_parser() -> argparse.ArgumentParser:
    return add_parser(argparse.ArgumentParser().add_subparsers())


def _flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_prefill_and_decode_executors_with_their_cores():
    config = stack_config(
        build_parser().parse_args(["--prefill", "1", "--decode", "1", "--executor-cpus", "0;1"])
    )
    assert (config.num_executors, config.num_prefill, config.num_decode) == (0, 1, 1)
    args = [executor_args(config, i) for i in range(2)]
    assert [_flag(a, "--role") for a in args] == ["prefill", "decode"]
    assert [_flag(a, "--cpus") for a in args] == ["0", "1"]
    assert [_flag(a, "--num-threads") for a in args] == ["1", "1"]


def test_executors_alone_stay_role_both_and_unpinned():
    config = stack_config(build_parser().parse_args(["--executors", "2"]))
    args = [executor_args(config, i) for i in range(2)]
    assert [_flag(a, "--role") for a in args] == ["both", "both"]
    assert [_flag(a, "--cpus") for a in args] == [None, None]


def test_a_cpu_list_per_executor_must_cover_every_executor():
    with pytest.raises(ValueError, match="executor_cpus"):
        stack_config(build_parser().parse_args(["--executors", "2", "--executor-cpus", "0"]))


def test_cpu_lists():
    assert parse_cpu_list("0,2-3, 5") == (0, 2, 3, 5)
    assert parse_cpu_list("") == ()
    for bad in ("x", "3-1", "-1"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


def test_disaggregation_settings_reach_the_executors_and_schedulers():
    config = stack_config(
        build_parser().parse_args(
            [
                "--prefill",
                "1",
                "--decode",
                "1",
                "--kv-transfer-timeout",
                "30",
                "--disagg-min-uncached-tokens",
                "100",
                "--disagg-max-prefill-queue-tokens",
                "5000",
            ]
        )
    )
    assert _flag(executor_args(config, 0), "--kv-transfer-timeout") == "30.0"
    args = scheduler_args(config)
    assert _flag(args, "--disagg-min-uncached-tokens") == "100"
    assert _flag(args, "--disagg-max-prefill-queue-tokens") == "5000"
    # and the scheduler parses what the launcher writes
    parsed = parse_scheduler_config(args).router.disagg
    assert (parsed.min_uncached_tokens, parsed.max_prefill_queue_tokens) == (100, 5000)
