"""``llmserve up``: run the whole stack on this machine — nats-server, redis-server and every
service as its own process — and stop it all on Ctrl-C (or SIGTERM)."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from services.executor.config import SERVED_ENGINE_DEFAULTS, parse_cpu_list
from services.gateway.config import ENV_API_KEY, add_api_key_arguments, api_key_from_args
from services.runtime import env_str, env_value
from services.scheduler.placement import ROUTING_POLICIES
from services.served_models import pair_models
from shared.engine.config import EngineConfig, add_engine_arguments

if TYPE_CHECKING:
    from services.cli.launcher import StackConfig


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "up",
        help="start the whole stack locally (NATS, Redis, every service) and serve HTTP",
        description="Start nats-server and redis-server on free loopback ports (or use $NATS_URL / "
        "$REDIS_URL), then the executor, prefix index, scheduler, tokenizer and gateway services, "
        "each as its own process. Ctrl-C drains and stops everything.",
    )
    p.add_argument(
        "--model-name",
        action="append",
        default=None,
        help="name clients send as 'model': once per --model, in the same order (default: each "
        "model's file name)",
    )
    p.add_argument("--host", default="127.0.0.1", help="HTTP host of the gateway")
    p.add_argument(
        "--port",
        type=int,
        default=8000,
        help="HTTP port of the (first) gateway; gateway i listens on PORT+i (0: free ports)",
    )
    p.add_argument(
        "--gateways",
        type=int,
        default=1,
        help="gateway processes, each on its own port (consecutive from --port): put a load "
        "balancer in front, or spread clients over the printed URLs",
    )
    p.add_argument(
        "--executors",
        type=int,
        default=None,
        help="executor processes of role 'both' per model (each loads its model; default 1, or 0 "
        "with --prefill/--decode)",
    )
    p.add_argument(
        "--prefill",
        type=int,
        default=0,
        help="prefill executors per model: they run long prompts and hand the KV pages to a "
        "decode executor",
    )
    p.add_argument(
        "--decode", type=int, default=0, help="decode executors per model (take handoffs)"
    )
    p.add_argument(
        "--executor-cpus",
        default="",
        help="cores of each executor, ';' between executors in launch order (both, then prefill, "
        "then decode), e.g. '0;1' or '0-1;2-3' (default: no pinning)",
    )
    p.add_argument(
        "--kv-transfer-timeout",
        type=float,
        default=10.0,
        help="seconds a KV handoff from a prefill to a decode executor may take before the "
        "prefill executor decodes the request itself",
    )
    p.add_argument(
        "--disagg-min-uncached-tokens",
        type=int,
        default=256,
        help="with --prefill: prompts with fewer uncached tokens than this prefill where they "
        "decode",
    )
    p.add_argument(
        "--disagg-max-prefill-queue-tokens",
        type=int,
        default=16384,
        help="with --prefill: prefill locally when every prefill executor has more unstarted "
        "prefill tokens than this",
    )
    p.add_argument("--tokenizers", type=int, default=1, help="tokenizer processes")
    p.add_argument("--schedulers", type=int, default=1, help="scheduler processes")
    p.add_argument(
        "--prefix-indexes",
        type=int,
        default=1,
        help="prefix index processes (replicas over one Redis; 0: none, routing by load)",
    )
    p.add_argument(
        "--routing",
        choices=ROUTING_POLICIES,
        default="cache",
        help="how schedulers place requests: 'cache' (prefix index + load), 'load', 'round_robin'",
    )
    p.add_argument(
        "--max-queued",
        type=int,
        default=None,
        help="requests each executor accepts beyond --max-num-seqs (default: as many again)",
    )
    p.add_argument(
        "--max-queue-len", type=int, default=256, help="waiting requests beyond this get 429"
    )
    add_api_key_arguments(p)
    p.add_argument(
        "--credentials",
        default=env_str("LLMSERVE_CREDENTIALS_DIR", None),
        metavar="DIR",
        help="the NATS and Redis users from `llmserve credentials DIR` instead of fresh ones: "
        "each service gets its kind's; needed to close a bus given by $NATS_URL / $REDIS_URL "
        "[env LLMSERVE_CREDENTIALS_DIR]",
    )
    p.add_argument(
        "--request-timeout", type=float, default=None, help="seconds before a request is aborted"
    )
    p.add_argument(
        "--ready-timeout",
        type=float,
        default=300.0,
        help="seconds to wait for the stack to be ready",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=5.0,
        help="seconds in-flight requests get on shutdown",
    )
    p.add_argument("--log-dir", default=None, help="write each service's log to <dir>/<name>.log")
    p.add_argument(
        "--observability",
        action="store_true",
        help="also start a local Prometheus (scraping every gateway) and trace backend (Jaeger "
        "or Arize Phoenix) where installed, and print their URLs; says what is not installed",
    )
    # Every executor's engine; num_threads None is resolved per executor by the launcher.
    add_engine_arguments(
        p,
        SERVED_ENGINE_DEFAULTS,
        repeatable=("model",),
        help={
            "model": "GGUF file or Hugging Face directory; repeat it to serve several models at "
            "once (default: the bundled SmolLM2-135M-Instruct)",
            "num_threads": (
                "torch threads per executor (default: the cores divided among the executors)"
            ),
        },
    )
    p.set_defaults(func=run)
    return p


def _note(msg: str) -> None:
    print(f"llmserve: {msg}", file=sys.stderr, flush=True)


def _curl_example(base_url: str, model: str, api_key_file: str | None, with_key: bool) -> str:
    """A request to paste into a shell. The key itself is never printed (a terminal's scrollback,
    a CI log): the shell fills it in from $LLMSERVE_API_KEY, read from the key's file if that is
    where it came from."""
    setup = (
        f'export {ENV_API_KEY}="$(head -n 1 {shlex.quote(api_key_file)})"\n' if api_key_file else ""
    )
    auth = f' \\\n    -H "Authorization: Bearer ${ENV_API_KEY}"' if with_key else ""
    return (
        f"{setup}curl -N {base_url}/v1/chat/completions \\\n"
        f"    -H 'Content-Type: application/json'{auth} \\\n"
        f'    -d \'{{"model": "{model}", "stream": true, "max_tokens": 32, '
        f'"messages": [{{"role": "user", "content": "Hello!"}}]}}\''
    )


def stack_config(args: argparse.Namespace) -> StackConfig:
    """The stack the command line asks for; ValueError for a bad combination of flags."""
    from services.cli.credentials import StackCredentials
    from services.cli.launcher import StackConfig

    engine = EngineConfig.from_args(
        args, EngineConfig.from_env(env_value, SERVED_ENGINE_DEFAULTS), exclude=("model",)
    )
    # Without --model, the one model of $LLMSERVE_MODEL or the default; the engine keeps no model
    # of its own, so each executor gets its model's path alone.
    models = pair_models(getattr(args, "model", None) or [engine.model], args.model_name or [])
    return StackConfig(
        engine=replace(engine, model=None),
        models=models,
        host=args.host,
        port=args.port,
        num_gateways=args.gateways,
        num_executors=(
            args.executors
            if args.executors is not None
            else (0 if args.prefill or args.decode else 1)
        ),
        num_prefill=args.prefill,
        num_decode=args.decode,
        executor_cpus=tuple(
            parse_cpu_list(part) for part in args.executor_cpus.split(";") if part.strip()
        ),
        kv_transfer_timeout_s=args.kv_transfer_timeout,
        disagg_min_uncached_tokens=args.disagg_min_uncached_tokens,
        disagg_max_prefill_queue_tokens=args.disagg_max_prefill_queue_tokens,
        num_tokenizers=args.tokenizers,
        num_schedulers=args.schedulers,
        num_prefix_indexes=args.prefix_indexes,
        routing=args.routing,
        max_queued=args.max_queued,
        max_queue_len=args.max_queue_len,
        api_key=api_key_from_args(args),
        credentials=StackCredentials.load(args.credentials) if args.credentials else None,
        request_timeout_s=args.request_timeout,
        nats_url=env_str("NATS_URL", None),
        redis_url=env_str("REDIS_URL", None),
        log_dir=args.log_dir,
        ready_timeout_s=args.ready_timeout,
        drain_timeout_s=args.drain_timeout,
        observability=args.observability,
    )


def run(args: argparse.Namespace) -> int:
    from services.cli.launcher import StackStartError, launch, served_models
    from services.cli.servers import ServerStartError

    try:
        config = stack_config(args)
    except ValueError as e:
        _note(f"error: {e}")
        return 2
    models = served_models(config)
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)

    # SIGTERM takes the same path as Ctrl-C: unwind, drain, stop every child. SIGINT is installed
    # explicitly: a process started in the background by a non-interactive shell (`sh -c '... &'`,
    # nohup, some CI runners) inherits SIGINT as ignored, and Python then leaves it ignored.
    def on_stop_signal(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_stop_signal)
    signal.signal(signal.SIGINT, on_stop_signal)

    for m in models:
        _note(
            f"starting {config.executors_per_model} executor(s) with "
            f"{m.path or 'the default model'} as "
            f"{m.name}; the model loads in each executor (progress below)"
        )
    stack = None
    try:
        stack = launch(config, progress=_note)
        curl = _curl_example(
            stack.base_url, models[0].name, args.api_key_file, config.api_key is not None
        )
        more = "".join(f"\n  gateway {i}: {url}" for i, url in enumerate(stack.base_urls))
        more = more if len(stack.base_urls) > 1 else ""
        more += "".join(f"\n  {name}: {url}" for name, url in stack.observability.items())
        print(
            f"\nllmserve is ready at {stack.base_url}  (Ctrl-C to stop), serving "
            f"{', '.join(m.name for m in models)}{more}\n\n"
            f"{curl}\n",
            flush=True,
        )
        while True:
            time.sleep(0.5)
            stack.supervise(_note)
    except KeyboardInterrupt:
        _note("stopping: draining in-flight requests...")
        return 0
    except (StackStartError, ServerStartError) as e:
        _note(f"error: {e}")
        return 1
    finally:
        if stack is not None:
            # A second Ctrl-C during the drain must not leave children behind.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            stack.stop()
            _note("stopped")
