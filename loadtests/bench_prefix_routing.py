"""Cache-aware routing against round robin, on the whole stack, in one run.

    python -m loadtests.bench_prefix_routing [--conversations 8 --turns 8 --system-len 1000 \
        --user-len 64 --output-len 128 --think-time 5 --stagger 0.6 --num-kv-blocks 480]

Two executors serve a multi-turn chat workload: every conversation opens with the same system
prompt (``--system-len`` tokens), and each turn's prompt is the previous turn's prompt plus the
reply it got (its text encoded again, as a chat server re-encodes a returned message) and a new
user message of ``--user-len`` tokens, so it extends the last one. The defaults have the shape of
chat traffic, short user messages and replies a few times longer, over eight turns: a history soon
outgrows what a turn adds, so a turn sent where its history is not cached recomputes several
times what it adds. Conversations start ``--stagger`` seconds apart and run their turns one after
another, a seeded think time apart (the user reading and typing; drawn per turn, so conversations
fall out of step and round robin places a turn independently of where the last one went, as it
does among many clients: in lock step, an even number of conversations would meet the same
executor every turn). Every request streams ``--output-len`` greedy tokens. The default cache
(``--num-kv-blocks`` per executor) holds the conversations once across the two executors but not
once on each (831 blocks against 2 x 480): placement decides which histories stay cached. The
same workload runs once per routing policy on a fresh stack (``--policies``); greedy decoding
does not depend on the batch, so both see the same prompts.

With two executors, round robin sends a later turn to the executor that served the turn before
about half the time (1/N with N executors); the rest, and the turns whose history its executors,
each caching every conversation, have evicted, recompute part of their history. So its median
request is a hit or a miss depending on how many of those it met (printed as "missed"), and the
ratio of the medians moves with that count.

Reported per policy:

- TTFT (mean, median, p99) as the client sees it, and the median of the requests that hit their
  ideal against those that missed part of it;
- prefix hit rate: the cached prompt tokens the executors report (usage.prompt_tokens_details
  .cached_tokens) over the ideal, the leading full blocks of each prompt that the prompts and
  replies sent before it had (what one executor with an unbounded cache, prefilling instantly,
  would hit);
- with cache routing, the index lookup the scheduler makes per request: the PREFIX_INDEX_MATCH
  round trip timed by this client over NATS with each prompt's block hashes, and the scheduler's
  own median.

System prompt and user messages are random token ids (seeded). Writes
loadtests/results/bench_prefix_routing.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from loadtests.bench_serving import CLIENT_ERRORS, client_session, percentile, sse_chunks
from loadtests.results import write_json
from services.cli.launcher import Stack, StackConfig, launch
from services.scheduler.placement import ROUTING_POLICIES
from shared.engine.default_model import default_model_path
from shared.engine.tokenizer.tokenizer import Tokenizer
from shared.wire import messages, subjects
from shared.wire.block_hash import hash_prompt_blocks
from shared.wire.bus import Bus
from shared.wire.messages import PrefixMatchRequest

# Token ids drawn from here: ordinary vocabulary of the default model, no special tokens.
TOKEN_RANGE = (1000, 40000)
MODEL_NAME = "SmolLM2-135M-Instruct"
BLOCK_SIZE = 16


@dataclass
class Turn:
    conversation: int
    turn: int
    prompt: list[int]
    text: str = ""
    reply: list[int] = field(default_factory=list)  # the text encoded again
    sent_at: float = 0.0
    finished_at: float = 0.0
    ttft_s: float = 0.0
    cached_tokens: int = 0
    ideal_cached_tokens: int = 0
    ok: bool = False
    error: str = ""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-len", type=int, default=1000, help="shared system prompt, tokens")
    p.add_argument("--user-len", type=int, default=64, help="tokens each user turn adds")
    p.add_argument("--output-len", type=int, default=128, help="tokens of each reply")
    p.add_argument("--stagger", type=float, default=0.6, help="seconds between conversations")
    p.add_argument(
        "--think-time",
        type=float,
        default=5.0,
        help="mean seconds between a reply's end and the conversation's next turn (the user "
        "reading and typing), each drawn uniformly from [0, 2 x mean]",
    )
    p.add_argument("--executors", type=int, default=2)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument(
        "--num-kv-blocks",
        type=int,
        default=480,
        help="KV blocks of 16 tokens per executor (0: from a 1GiB budget); a pool that holds one "
        "copy of the conversations (the working set printed at the start) but not one on every "
        "executor, as here, shows what placement saves",
    )
    p.add_argument("--policies", default="cache,round_robin")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="loadtests/results/bench_prefix_routing.json")
    args = p.parse_args(argv)
    for policy in args.policies.split(","):
        if policy not in ROUTING_POLICIES:
            p.error(f"unknown policy {policy!r}; choose from {ROUTING_POLICIES}")
    return args


def build_messages(args: argparse.Namespace) -> tuple[list[int], list[list[list[int]]]]:
    """The shared system prompt and user[c][t], conversation c's user message at turn t."""
    rng = random.Random(args.seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]

    system = ids(args.system_len)
    users = [[ids(args.user_len) for _ in range(args.turns)] for _ in range(args.conversations)]
    return system, users


def think_times(args: argparse.Namespace) -> list[list[float]]:
    """think[c][t]: the pause before conversation c's turn t + 1, the same under every policy."""
    rng = random.Random(args.seed + 1)
    return [
        [rng.uniform(0, 2 * args.think_time) for _ in range(args.turns - 1)]
        for _ in range(args.conversations)
    ]


def working_set_blocks(args: argparse.Namespace) -> int:
    """Blocks holding every conversation's full history once: the shared system prompt, then each
    conversation's own user turns and replies (replies re-encoded may differ by a few tokens)."""
    own_tokens = args.turns * (args.user_len + args.output_len)
    return -(-args.system_len // BLOCK_SIZE) + args.conversations * -(-own_tokens // BLOCK_SIZE)


def ideal_cached_tokens(turns: list[Turn], block_size: int) -> None:
    """Fill each turn's ideal: the leading full blocks found among the prompts and replies of the
    requests sent before it (what one executor with an unbounded cache, prefilling instantly, would
    hit; its own last block excluded: a prompt's final token is always computed, as the engine
    does)."""
    known: set[int] = set()
    for t in sorted(turns, key=lambda t: t.sent_at):
        usable = hash_prompt_blocks(t.prompt, block_size)[: (len(t.prompt) - 1) // block_size]
        n = 0
        while n < len(usable) and usable[n] in known:
            n += 1
        t.ideal_cached_tokens = n * block_size
        known.update(hash_prompt_blocks(t.prompt + t.reply, block_size))


async def send(client: aiohttp.ClientSession, model: str, turn: Turn, output_len: int) -> None:
    body = {
        "model": model,
        "prompt": turn.prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    turn.sent_at = time.perf_counter()
    try:
        async with client.post("/v1/completions", json=body) as r:
            if r.status != 200:
                turn.error = f"{r.status}: {(await r.read())[:200]!r}"
                return
            async for chunk in sse_chunks(r):
                if "error" in chunk:
                    turn.error = json.dumps(chunk["error"])[:200]
                    return
                text = "".join(c.get("text") or "" for c in chunk.get("choices", []))
                if text and turn.ttft_s == 0.0:
                    turn.ttft_s = time.perf_counter() - turn.sent_at
                turn.text += text
                usage = chunk.get("usage")
                if usage:
                    details = usage.get("prompt_tokens_details") or {}
                    turn.cached_tokens = details.get("cached_tokens") or 0
        turn.ok = turn.ttft_s > 0
    except CLIENT_ERRORS as e:
        turn.error = f"{type(e).__name__}: {e}"[:200]
    finally:
        turn.finished_at = time.perf_counter()


async def run_workload(base_url: str, args: argparse.Namespace) -> list[Turn]:
    system, users = build_messages(args)
    think = think_times(args)
    tokenizer = Tokenizer.from_path(default_model_path())
    turns: list[Turn] = []
    async with client_session(base_url, args.conversations + 4, 600) as client:
        async with client.get("/v1/models") as r:
            model = (await r.json())["data"][0]["id"]

        async def conversation(c: int) -> None:
            await asyncio.sleep(c * args.stagger)
            prompt = system + users[c][0]
            for t in range(args.turns):
                turn = Turn(c, t, prompt)
                turns.append(turn)
                await send(client, model, turn, args.output_len)
                if not turn.ok or t + 1 == args.turns:
                    return
                turn.reply = tokenizer.encode(turn.text, add_special_tokens=False)
                prompt = prompt + turn.reply + users[c][t + 1]
                await asyncio.sleep(think[c][t])

        await asyncio.gather(*(conversation(c) for c in range(args.conversations)))
    return sorted(turns, key=lambda t: (t.conversation, t.turn))


async def time_index_lookups(stack: Stack, prompts: list[list[int]]) -> list[float]:
    """The scheduler's lookup, from here: one PREFIX_INDEX_MATCH round trip per prompt, in ms."""
    bus = await Bus.connect(stack.nats_url, "bench-prefix-routing", auth=stack.admin_auth)
    samples = []
    try:
        for prompt in prompts:
            query = PrefixMatchRequest(
                model=MODEL_NAME, block_hashes=hash_prompt_blocks(prompt, BLOCK_SIZE)
            )
            data = messages.PREFIX_MATCH_REQUEST.encode(query)
            t0 = time.perf_counter()
            reply = messages.PREFIX_MATCH_REPLY.decode(
                await bus.request(subjects.PREFIX_INDEX_MATCH, data, timeout=5)
            )
            samples.append((time.perf_counter() - t0) * 1e3)
            if reply.error:
                raise RuntimeError(f"the index could not answer: {reply.error}")
    finally:
        await bus.close()
    return samples


async def scheduler_status(stack: Stack) -> messages.SchedulerStatus:
    bus = await Bus.connect(stack.nats_url, "bench-prefix-routing-status", auth=stack.admin_auth)
    try:
        data = await bus.request(
            subjects.SCHEDULER_STATUS,
            messages.SCHEDULER_STATUS_REQUEST.encode(messages.SchedulerStatusRequest()),
            timeout=5,
        )
        return messages.SCHEDULER_STATUS.decode(data)
    finally:
        await bus.close()


def summarize(policy: str, turns: list[Turn], extra: dict[str, Any]) -> dict[str, Any]:
    ok = [t for t in turns if t.ok]
    ttft_ms = [t.ttft_s * 1e3 for t in ok]
    missed = [t.ttft_s * 1e3 for t in ok if t.cached_tokens < t.ideal_cached_tokens]
    hit = [t.ttft_s * 1e3 for t in ok if t.cached_tokens >= t.ideal_cached_tokens]
    cached = sum(t.cached_tokens for t in ok)
    ideal = sum(t.ideal_cached_tokens for t in ok)
    return {
        "policy": policy,
        "num_requests": len(turns),
        "num_failed": len(turns) - len(ok),
        "errors": sorted({t.error for t in turns if t.error})[:5],
        "ttft_ms": {
            "mean": statistics.fmean(ttft_ms) if ttft_ms else 0.0,
            "median": percentile(ttft_ms, 50),
            "p99": percentile(ttft_ms, 99),
            "hit_median": percentile(hit, 50) if hit else 0.0,
            "missed_median": percentile(missed, 50) if missed else 0.0,
        },
        "num_missed": len(missed),
        "cached_tokens": cached,
        "ideal_cached_tokens": ideal,
        "hit_rate_of_ideal": cached / ideal if ideal else 0.0,
        "prompt_tokens": sum(len(t.prompt) for t in ok),
        **extra,
        "requests": [
            asdict(t) | {"prompt": len(t.prompt), "text": None, "reply": len(t.reply)}
            for t in turns
        ],
    }


def run_policy(policy: str, args: argparse.Namespace) -> dict[str, Any]:
    print(f"[{policy}] starting a stack with {args.executors} executors...", file=sys.stderr)
    config = StackConfig.of(
        port=0,
        num_executors=args.executors,
        routing=policy,
        model_name=MODEL_NAME,
        dtype=args.dtype,
        num_threads=1,
        max_num_seqs=args.max_num_seqs,
        memory_budget="1GiB",
        num_kv_blocks=args.num_kv_blocks or None,
        block_size=BLOCK_SIZE,
    )
    with launch(config) as stack:
        t0 = time.perf_counter()
        turns = asyncio.run(run_workload(stack.base_url, args))
        duration = time.perf_counter() - t0
        extra: dict[str, Any] = {"duration_s": duration}
        if policy == "cache":
            lookups = asyncio.run(time_index_lookups(stack, [t.prompt for t in turns]))
            status = asyncio.run(scheduler_status(stack))
            extra["index_lookup_ms"] = {
                "median": percentile(lookups, 50),
                "p99": percentile(lookups, 99),
                "scheduler_median": status.index_lookup_ms_p50,
            }
            extra["index_fallbacks"] = status.num_index_fallbacks
    ideal_cached_tokens(turns, BLOCK_SIZE)
    return summarize(policy, turns, extra)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.num_kv_blocks:
        print(
            f"working set {working_set_blocks(args)} KV blocks; "
            f"{args.executors} x {args.num_kv_blocks} in the pool",
            file=sys.stderr,
        )
    results = {p: run_policy(p, args) for p in args.policies.split(",")}
    print(
        f"\n{'policy':<12} {'ok':>4} {'TTFT med':>9} {'mean':>8} {'p99':>8} {'hit/ideal':>9} "
        f"{'missed':>6} {'TTFT med hit / missed':>22}"
    )
    for r in results.values():
        t = r["ttft_ms"]
        print(
            f"{r['policy']:<12} {r['num_requests'] - r['num_failed']:>4} {t['median']:>8.0f}m "
            f"{t['mean']:>7.0f}m {t['p99']:>7.0f}m {r['hit_rate_of_ideal']:>9.1%} "
            f"{r['num_missed']:>6} {t['hit_median']:>11.0f}m / {t['missed_median']:>6.0f}m"
        )
    ratios: dict[str, float] = {}
    if "cache" in results and "round_robin" in results:
        ratios["median_ttft_cache_over_round_robin"] = (
            results["cache"]["ttft_ms"]["median"] / results["round_robin"]["ttft_ms"]["median"]
        )
        ratio = ratios["median_ttft_cache_over_round_robin"]
        print(f"median TTFT, cache / round robin: {ratio:.2f}")
    if "cache" in results:
        lk = results["cache"]["index_lookup_ms"]
        print(
            f"index lookup: median {lk['median']:.2f} ms, p99 {lk['p99']:.2f} ms (client); "
            f"scheduler's median {lk['scheduler_median']:.2f} ms"
        )
    path = write_json(args.out, {"args": vars(args), "ratios": ratios, "results": results})
    print(f"wrote {path}")
    return 0 if all(r["num_failed"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
