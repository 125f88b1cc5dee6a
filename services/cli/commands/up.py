"""``llmserve up``: run the whole stack on this machine — nats-server, redis-server and every service
as its own process — and stop it all on Ctrl-C (or SIGTERM)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Any

from shared.engine.quantization import KV_CACHE_DTYPE_HELP, KV_CACHE_DTYPES, QUANTIZATION_HELP, QUANTIZATIONS

WEIGHT_DTYPES = ("bfloat16", "float16", "float32")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "up", help="start the whole stack locally (NATS, Redis, every service) and serve HTTP",
        description="Start nats-server and redis-server on free loopback ports (or use $NATS_URL / "
                    "$REDIS_URL), then the executor, scheduler, tokenizer and gateway services, each "
                    "as its own process. Ctrl-C drains and stops everything.")
    p.add_argument("--model", default=None,
                   help="GGUF file or Hugging Face directory (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--model-name", default=None, help="name clients send as 'model' (default: the model's)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP host of the gateway")
    p.add_argument("--port", type=int, default=8000, help="HTTP port of the gateway (0: a free port)")
    p.add_argument("--executors", type=int, default=1, help="executor processes (each loads the model)")
    p.add_argument("--tokenizers", type=int, default=1, help="tokenizer processes")
    p.add_argument("--dtype", choices=WEIGHT_DTYPES, default="bfloat16")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=None, help=QUANTIZATION_HELP)
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help=KV_CACHE_DTYPE_HELP)
    p.add_argument("--memory-budget", default="2GiB", help="per executor: weights + activations + KV cache")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks per executor (overrides the budget)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences one executor batches at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget of one engine step")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch threads per executor (default: the cores divided among the executors)")
    p.add_argument("--max-queue-len", type=int, default=256, help="waiting requests beyond this get 429")
    p.add_argument("--api-key", default=os.environ.get("LLMSERVE_API_KEY") or None,
                   help="require 'Authorization: Bearer <key>' (env LLMSERVE_API_KEY)")
    p.add_argument("--request-timeout", type=float, default=None, help="seconds before a request is aborted")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for the stack to be ready")
    p.add_argument("--drain-timeout", type=float, default=5.0, help="seconds in-flight requests get on shutdown")
    p.add_argument("--log-dir", default=None, help="write each service's log to <dir>/<name>.log")
    p.set_defaults(func=run)
    return p


def _note(msg: str) -> None:
    print(f"llmserve: {msg}", file=sys.stderr, flush=True)


def _curl_example(base_url: str, model: str, api_key: str | None) -> str:
    auth = f" \\\n    -H 'Authorization: Bearer {api_key}'" if api_key else ""
    return (f"curl -N {base_url}/v1/chat/completions \\\n    -H 'Content-Type: application/json'{auth} \\\n"
            f"    -d '{{\"model\": \"{model}\", \"stream\": true, \"max_tokens\": 32, "
            f"\"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'")


def run(args: argparse.Namespace) -> int:
    from services.cli.launcher import StackConfig, StackStartError, launch, served_model_name
    from services.cli.servers import ServerStartError

    config = StackConfig(
        model=args.model, model_name=args.model_name, host=args.host, port=args.port,
        num_executors=args.executors, num_tokenizers=args.tokenizers, dtype=args.dtype, quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        memory_budget=args.memory_budget, num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        num_threads=args.num_threads, max_queue_len=args.max_queue_len, api_key=args.api_key,
        request_timeout_s=args.request_timeout, nats_url=os.environ.get("NATS_URL") or None,
        redis_url=os.environ.get("REDIS_URL") or None, log_dir=args.log_dir,
        ready_timeout_s=args.ready_timeout, drain_timeout_s=args.drain_timeout)
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)

    # SIGTERM takes the same path as Ctrl-C: unwind, drain, stop every child. SIGINT is installed
    # explicitly: a process started in the background by a non-interactive shell (`sh -c '... &'`,
    # nohup, some CI runners) inherits SIGINT as ignored, and Python then leaves it ignored.
    def on_stop_signal(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, on_stop_signal)
    signal.signal(signal.SIGINT, on_stop_signal)

    _note(f"starting {args.executors} executor(s) with {args.model or 'the default model'}; "
          f"the model loads in each executor (progress below)")
    stack = None
    try:
        stack = launch(config, progress=_note)
        model = served_model_name(config)
        print(f"\nllmserve is ready at {stack.base_url}  (Ctrl-C to stop)\n\n"
              f"{_curl_example(stack.base_url, model, args.api_key)}\n", flush=True)
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
