"""``llmserve plan``: print the memory ledger (weights, activations, KV cache) for a model and
budget."""

from __future__ import annotations

import argparse
import json
from typing import Any

from shared.engine.plan_report import KV_DTYPES, WEIGHT_DTYPES
from shared.engine.quantization import QUANTIZATION_HELP, QUANTIZATIONS, kv_dtype_name


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "plan",
        help="show how a memory budget splits into weights, activations and KV cache",
        description=(
            "Show how a memory budget splits into weights, activations and KV cache blocks."
        ),
    )
    parser.add_argument(
        "--model",
        default=None,
        help="known model name (e.g. llama-3-8b), .gguf file or Hugging Face directory; "
        "default: the bundled SmolLM2-135M-Instruct GGUF",
    )
    parser.add_argument("--memory", required=True, help="memory budget, e.g. 80GiB, 24GB, 512MiB")
    parser.add_argument(
        "--context",
        type=int,
        default=None,
        help="context length per request (default: the model's maximum)",
    )
    parser.add_argument(
        "--dtype", choices=WEIGHT_DTYPES, default="float16", help="weight and activation dtype"
    )
    parser.add_argument(
        "--kv-dtype",
        choices=KV_DTYPES,
        default="auto",
        help="KV cache dtype (auto: --dtype; int8, fp8: the engine's int8 and e4m3 caches, a "
        "4-byte scale per token and KV head included)",
    )
    parser.add_argument(
        "--quantization", choices=QUANTIZATIONS, default=None, help=QUANTIZATION_HELP
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="token budget of one step"
    )
    parser.add_argument("--max-num-seqs", type=int, default=256, help="sequences in one step")
    parser.add_argument("--json", action="store_true", help="print the ledger as JSON")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    settings = dict(
        memory=args.memory,
        dtype=args.dtype,
        kv_dtype=args.kv_dtype,
        quantization=args.quantization,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        context=args.context,
    )
    if args.json:
        from shared.engine.plan_report import plan_report

        print(json.dumps(plan_report(args.model, **settings), indent=2))
        return 0
    from shared.engine.memory import format_ledger, parse_bytes, plan_memory
    from shared.engine.models.known_configs import resolve_model

    model = resolve_model(args.model)
    ledger = plan_memory(
        model.config,
        memory_budget_bytes=parse_bytes(args.memory),
        weight_dtype=args.dtype,
        kv_dtype=kv_dtype_name(args.kv_dtype, args.dtype),
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        context_len=args.context,
        num_params=model.num_params,
        quantization=args.quantization,
        gguf_formats=model.gguf_formats,
        gguf_head_format=model.gguf_head_format,
    )
    print(format_ledger(ledger, model.config))
    return 0
