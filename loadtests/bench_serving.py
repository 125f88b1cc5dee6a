"""OpenAI-compatible serving benchmark: the same client for llmserve and for any peer server.

    python loadtests/bench_serving.py --base-url http://127.0.0.1:8000 --num-prompts 64 \\
        --concurrency 8 --input-len 128 --output-len 64 --out loadtests/results/serving.json

Arrivals: a fixed number of concurrent clients (--concurrency), or a Poisson process
(--request-rate, requests/s; optionally capped by --max-concurrency). Every request streams (SSE)
and asks for exactly --output-len tokens (ignore_eos + max_tokens; --no-ignore-eos for servers that
reject the field).

Metrics, per request, as vLLM's benchmark_serving defines them:
    TTFT  first chunk carrying text − request sent
    ITL   gaps between consecutive text-carrying chunks
    TPOT  (E2E − TTFT) / (output tokens − 1)
    E2E   last byte − request sent
Output tokens come from the server's usage (stream_options.include_usage), else from the number of
text-carrying chunks. Reports mean / median / p99 (ms) plus request and token throughput; prints a
table and writes JSON (--out). Needs only aiohttp and msgspec (and, for exact prompt lengths,
--tokenizer).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import aiohttp
import msgspec

from loadtests.results import write_json

# Common English words: with a BPE vocabulary nearly all are one token after a space, so N words
# approximate N tokens without a tokenizer (--tokenizer makes it exact).
WORDS = """the of and to in is was for on that with as by at from his it an were are which this be
has had or not but first one new their its after who they have two her she been other when there all
during into school time may years more most only over city some world would where later up such used
many can state about national out known university united then made world year people between early
under three film well like government only part being so him made use people could life history game
house work group name day series city place water since number those music until war high both small
long second around common great general end family system area while found old before city through
light large team each best power main public country good began following several called back public
season line however early major down still area show make region village south north east west local
night form held set river high order death following much because company member led great point
""".split()
FIXED_TEXT = (
    "The quick brown fox jumps over the lazy dog while the patient engineer measures how "
    "long each token takes to arrive at the client across the network. "
)


@dataclass
class RequestResult:
    ok: bool = False
    status: int = 0
    error: str = ""
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    text_len: int = 0

    @property
    def tpot_s(self) -> float | None:
        return (
            (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)
            if self.output_tokens > 1
            else None
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    p.add_argument(
        "--model", default=None, help="model name (default: the first of GET /v1/models)"
    )
    p.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY") or os.environ.get("LLMSERVE_API_KEY")
    )
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--num-prompts", type=int, default=32)
    arrivals = p.add_mutually_exclusive_group()
    arrivals.add_argument(
        "--concurrency", type=int, default=None, help="fixed concurrent clients (default 4)"
    )
    arrivals.add_argument(
        "--request-rate", type=float, default=None, help="Poisson arrivals, requests/s"
    )
    p.add_argument(
        "--max-concurrency", type=int, default=None, help="cap in-flight requests (Poisson mode)"
    )
    p.add_argument(
        "--input-len",
        type=int,
        default=128,
        help="prompt length in tokens (approximate without --tokenizer)",
    )
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument(
        "--prompt-mode",
        choices=["words", "fixed", "ids"],
        default="words",
        help="words: random common words (distinct prompts); fixed: one fixed text for all "
        "(tokenizer-free, prefix-cache friendly); ids: random token ids (completions only)",
    )
    p.add_argument(
        "--vocab-range", default="100:20000", help="ids mode: token ids drawn from LOW:HIGH"
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="GGUF / tokenizer.json / HF dir to make text prompts exactly --input-len tokens",
    )
    p.add_argument(
        "--no-ignore-eos", action="store_true", help="do not send ignore_eos (OpenAI itself)"
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=1, help="requests sent (and discarded) first")
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="longest wait for the next bytes of a response, seconds",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument(
        "--save-requests", action="store_true", help="include per-request results in the JSON"
    )
    args = p.parse_args(argv)
    if args.request_rate is None and args.concurrency is None:
        args.concurrency = 4
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.prompt_mode == "ids" and args.endpoint == "chat":
        p.error("--prompt-mode ids needs --endpoint completions (chat content is text)")
    return args


# ------------------------------------------------------------------------------------- prompts


def _token_counter(path: str | None):
    if path is None:
        return None
    if path.endswith(".gguf") or os.path.isdir(path):
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from shared.engine.tokenizer import Tokenizer

        tok = Tokenizer.from_path(path)
        return lambda text: len(tok.encode(text, add_special_tokens=False))
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer.from_file(path)
    return lambda text: len(hf.encode(text, add_special_tokens=False).ids)


def _fit(words: list[str], target: int, count) -> str:
    """The longest prefix of ``words`` with at most ``target`` tokens (binary search)."""
    lo, hi = 1, len(words)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(" ".join(words[:mid])) <= target:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def make_prompts(args: argparse.Namespace, rng: random.Random) -> list[str | list[int]]:
    count = _token_counter(args.tokenizer)
    n = args.num_prompts + args.warmup
    if args.prompt_mode == "ids":
        low, high = (int(x) for x in args.vocab_range.split(":"))
        return [[rng.randrange(low, high) for _ in range(args.input_len)] for _ in range(n)]
    prompts: list[str | list[int]] = []
    for _ in range(n):
        if args.prompt_mode == "fixed":
            words = (FIXED_TEXT * (args.input_len // 10 + 2)).split()
        else:
            words = [rng.choice(WORDS) for _ in range(args.input_len * (2 if count else 1))]
        prompts.append(
            _fit(words, args.input_len, count) if count else " ".join(words[: args.input_len])
        )
    return prompts


# ------------------------------------------------------------------------------------ requests


def request_body(args: argparse.Namespace, model: str, prompt: str | list[int]) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": args.output_len,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if not args.no_ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


# What a benchmark client catches of a request that went wrong: the connection, HTTP, the timeout.
CLIENT_ERRORS = (aiohttp.ClientError, TimeoutError)


def client_session(
    base_url: str, connections: int, timeout_s: float, headers: dict[str, str] | None = None
) -> aiohttp.ClientSession:
    """The benchmarks' HTTP client: aiohttp, whose C parser spends less of the host's CPU per
    streamed token than httpx (the client shares the cores with the server it measures). Up to
    ``connections`` at once; ``timeout_s``: the longest wait for a response's next bytes (a stream
    may run longer than that in all)."""
    return aiohttp.ClientSession(
        base_url=base_url.rstrip("/"),
        headers=headers,
        connector=aiohttp.TCPConnector(limit=connections),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=timeout_s),
        read_bufsize=1 << 20,  # the longest SSE line it reads whole
    )


async def sse_chunks(response: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """The JSON of each ``data:`` line of an OpenAI-style SSE stream, up to ``[DONE]``. Parsed by
    msgspec rather than ``json``, since it costs less CPU per line: the client shares the host with
    the stack it measures, and every token is a line."""
    async for line in response.content:
        if not line.startswith(b"data: "):
            continue
        data = line[6:].rstrip(b"\r\n")
        if data == b"[DONE]":
            return
        yield msgspec.json.decode(data)


async def send_one(
    client: aiohttp.ClientSession, url: str, body: dict[str, Any], chat: bool
) -> RequestResult:
    res = RequestResult()
    num_chunks = 0
    start = time.perf_counter()
    last = start
    try:
        async with client.post(url, json=body) as r:
            res.status = r.status
            if r.status != 200:
                res.error = (await r.read()).decode(errors="replace")[:300]
                return res
            async for chunk in sse_chunks(r):
                if "error" in chunk:
                    res.error = json.dumps(chunk["error"])[:300]
                    return res
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"].get("completion_tokens", 0)
                text = "".join(
                    (c.get("delta", {}).get("content") or "") if chat else (c.get("text") or "")
                    for c in chunk.get("choices", [])
                )
                if text:
                    now = time.perf_counter()
                    if num_chunks == 0:
                        res.ttft_s = now - start
                    else:
                        res.itl_s.append(now - last)
                    last = now
                    num_chunks += 1
                    res.text_len += len(text)
        res.e2e_s = time.perf_counter() - start
        res.output_tokens = res.output_tokens or num_chunks
        res.ok = num_chunks > 0
        if not res.ok:
            res.error = "no text in the stream"
    except (*CLIENT_ERRORS, msgspec.DecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"[:300]
    return res


async def run(
    args: argparse.Namespace, after_warmup: Callable[[], Awaitable[None]] | None = None
) -> dict[str, Any]:
    """The benchmark's summary. ``after_warmup``: awaited between the warm-up requests and the
    timed ones (e.g. to read the server's counters the timed part is measured against)."""
    rng = random.Random(args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limit = args.concurrency or args.max_concurrency or args.num_prompts
    async with client_session(args.base_url, limit + 1, args.timeout, headers) as client:
        model = args.model
        if model is None:
            async with client.get("/v1/models") as r:
                r.raise_for_status()
                model = (await r.json())["data"][0]["id"]
        url = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
        chat = args.endpoint == "chat"
        prompts = make_prompts(args, rng)
        for prompt in prompts[: args.warmup]:
            warm = await send_one(client, url, request_body(args, model, prompt), chat)
            if not warm.ok:
                raise SystemExit(f"warm-up request failed ({warm.status}): {warm.error}")
        prompts = prompts[args.warmup :]
        if after_warmup is not None:
            await after_warmup()
        results: list[RequestResult] = [RequestResult() for _ in prompts]
        sem = asyncio.Semaphore(limit)

        async def one(i: int) -> None:
            async with sem:
                results[i] = await send_one(
                    client, url, request_body(args, model, prompts[i]), chat
                )

        start = time.perf_counter()
        if args.request_rate is None or math.isinf(args.request_rate):
            await asyncio.gather(*(one(i) for i in range(len(prompts))))
        else:
            tasks = []
            for i in range(len(prompts)):
                tasks.append(asyncio.create_task(one(i)))
                await asyncio.sleep(rng.expovariate(args.request_rate))
            await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(args, model, results, duration)


# ------------------------------------------------------------------------------------- report


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return float("nan")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _stats_ms(values: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values]
    if not ms:
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
    return {
        "mean": statistics.fmean(ms),
        "median": statistics.median(ms),
        "p99": percentile(ms, 99),
    }


def summarize(
    args: argparse.Namespace, model: str, results: list[RequestResult], duration: float
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = f"{r.status} {r.error[:120]}"
            errors[key] = errors.get(key, 0) + 1
    summary = {
        "config": {k: v for k, v in vars(args).items() if k not in ("api_key", "out")},
        "model": model,
        "duration_s": duration,
        "num_requests": len(results),
        "num_completed": len(ok),
        "num_failed": len(results) - len(ok),
        "errors": errors,
        "request_throughput_rps": len(ok) / duration,
        "output_throughput_tps": out_tokens / duration,
        "total_output_tokens": out_tokens,
        "mean_output_tokens": out_tokens / len(ok) if ok else 0.0,
        "ttft_ms": _stats_ms([r.ttft_s for r in ok]),
        "tpot_ms": _stats_ms([t for r in ok if (t := r.tpot_s) is not None]),
        "itl_ms": _stats_ms([g for r in ok for g in r.itl_s]),
        "e2e_ms": _stats_ms([r.e2e_s for r in ok]),
    }
    if args.save_requests:
        summary["requests"] = [asdict(r) for r in results]
    return summary


def print_report(s: dict[str, Any]) -> None:
    c = s["config"]
    arrivals = (
        f"concurrency {c['concurrency']}"
        if c["concurrency"]
        else f"Poisson {c['request_rate']} req/s"
    )
    print(f"\n{'=' * 20} serving benchmark {'=' * 20}")
    print(f"{'model':<28}{s['model']}\n{'arrivals':<28}{arrivals}")
    print(
        f"{'prompt / output tokens':<28}{c['input_len']} / {c['output_len']} ({c['prompt_mode']})"
    )
    print(f"{'completed / failed':<28}{s['num_completed']} / {s['num_failed']}")
    print(f"{'duration (s)':<28}{s['duration_s']:.2f}")
    print(f"{'request throughput (req/s)':<28}{s['request_throughput_rps']:.3f}")
    print(f"{'output throughput (tok/s)':<28}{s['output_throughput_tps']:.2f}")
    print(f"{'mean output tokens':<28}{s['mean_output_tokens']:.1f}")
    print(f"\n{'(ms)':<8}{'mean':>12}{'median':>12}{'p99':>12}")
    for key in ("ttft", "tpot", "itl", "e2e"):
        m = s[f"{key}_ms"]
        print(f"{key.upper():<8}{m['mean']:>12.2f}{m['median']:>12.2f}{m['p99']:>12.2f}")
    for err, n in s["errors"].items():
        print(f"error x{n}: {err}")
    print("=" * 59)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    summary = asyncio.run(run(args))
    print_report(summary)
    if args.out:
        print(f"wrote {write_json(args.out, summary)}")
    return 0 if summary["num_failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
