"""``llmserve generate``: offline batch generation from the command line, with a progress bar."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from services.runtime import env_value
from shared.engine.config import EngineConfig, add_engine_arguments

# --seed here is the sampling seed of every request (SamplingParams.seed), so the engine's global
# seed keeps its default (and its environment variable).
ENGINE_EXCLUDED = ("seed",)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "generate",
        help="generate completions offline (no servers)",
        description="Generate completions for prompts with the in-process engine.",
    )
    parser.add_argument("prompts", nargs="*", help="prompt texts (or use --prompts-file)")
    parser.add_argument("--prompts-file", help="a file with one prompt per line ('-' for stdin)")
    parser.add_argument(
        "--chat",
        action="store_true",
        help="wrap each prompt as a user message in the chat template",
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_engine_arguments(parser, exclude=ENGINE_EXCLUDED)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    prompts = list(args.prompts)
    if args.prompts_file:
        with sys.stdin if args.prompts_file == "-" else open(args.prompts_file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        raise ValueError("no prompts given: pass them as arguments or with --prompts-file")

    from shared.engine.llm import LLM
    from shared.wire.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        n=args.n,
        stop=args.stop,
    )
    engine_config = EngineConfig.from_args(
        args, EngineConfig.from_env(env_value), exclude=ENGINE_EXCLUDED
    )
    llm = LLM(engine_config)
    if args.chat:
        prompts = [
            llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts
        ]
    results = llm.generate(prompts, params, progress=True)
    for prompt, result in zip(prompts, results, strict=True):
        for choice in result.outputs:
            if args.json:
                print(
                    json.dumps(
                        {
                            "prompt": prompt,
                            "index": choice.index,
                            "text": choice.text,
                            "finish_reason": choice.finish_reason,
                            "num_prompt_tokens": len(result.prompt_token_ids),
                            "num_output_tokens": len(choice.token_ids),
                        }
                    )
                )
            else:
                print(f"--- {prompt!r} [{choice.index}] ({choice.finish_reason})\n{choice.text}")
    return 0
