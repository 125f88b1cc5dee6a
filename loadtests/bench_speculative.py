"""Speculative decoding against plain decoding, in one run, on the in-process engine.

Three measurements, each taking turns with its plain counterpart for ``--rounds`` rounds (the
median of each is reported); plain runs are the same engine's requests with ``speculative=False``,
so both sides share the process, the weights and the warm caches:

1. **n-gram, single stream**: ms per output token after the first (128 greedy tokens) on each
   workload, its speedup over plain decoding, the share of proposals accepted and the tokens a
   sequence's step yields. Workloads: *code edit* (a function rewritten with a renamed variable:
   the answer quotes most of the prompt), *quote* (a summary that quotes its source), and *random
   text* (a prompt of random words: nothing to look up but what the model repeats of itself).
2. **draft, single stream**: the same against K (proposals per step), on *code edit* and *random
   text*, with the model's int8 twin as the draft (``--speculative-draft-layers``: only its first
   layers; default all).
3. **batch size**: output tokens/s with and without n-gram speculation at several batch sizes on the
   code-edit workload: where verification stops paying (``speculative_max_num_seqs``).

    python -m loadtests.bench_speculative [--rounds 3] [--num-tokens 4] [--draft-ks 1,2,4,6,8]
        [--batch-sizes 1,2,4,8] [--out loadtests/results/bench_speculative.json]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from loadtests.results import write_json
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.speculative import DraftProposer
from shared.wire.sampling_params import SamplingParams

DEFAULT_OUT = "loadtests/results/bench_speculative.json"

_CODE = """def merge_sorted(left, right):
    merged = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            merged.append(left[i])
            i += 1
        else:
            merged.append(right[j])
            j += 1
    merged.extend(left[i:])
    merged.extend(right[j:])
    return merged
"""
_SOURCE = (
    "The committee met on Tuesday to review the budget. The chair said that the new library "
    "will open in March, that the bus route along the river will run every ten minutes, and "
    "that the swimming pool will close for repairs in the summer. A member asked whether the "
    "park would get new lights; the chair answered that the lights are planned for next year."
)
_WORDS = (
    "apple river stone quiet north paper window seven garden copper lantern orbit velvet "
    "harbor maple signal thunder pencil meadow silver canyon ribbon falcon marble echo"
).split()


def workloads() -> dict[str, list[dict[str, str]]]:
    """Chat conversations by name; ``random text`` is fixed by its seed."""
    rng = random.Random(0)
    words = " ".join(rng.choice(_WORDS) for _ in range(60))
    return {
        "code edit": [
            {
                "role": "user",
                "content": "Rewrite this function with the variable `merged` renamed to "
                f"`result`. Output only the code.\n\n{_CODE}",
            }
        ],
        "quote": [
            {
                "role": "user",
                "content": "Repeat the following report word for word, then give it a title.\n\n"
                + _SOURCE,
            }
        ],
        "random text": [{"role": "user", "content": f"Continue this list: {words}"}],
    }


def params(output_len: int, speculative: bool) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=output_len, ignore_eos=True, speculative=speculative
    )


def _spec_counters(engine: Engine) -> tuple[int, int, int]:
    s = engine.stats()
    return s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens


def single_stream(engine: Engine, prompt: list[int], p: SamplingParams) -> dict[str, float]:
    """One request alone: ms per output token after the first, and its speculation counters."""
    before = _spec_counters(engine)
    engine.add_request("single", prompt, p)
    first = end = None
    num_tokens = 0
    while engine.has_unfinished():
        for out in engine.step():
            num_tokens += sum(len(d.token_ids) for d in out.deltas)
            now = time.perf_counter()
            if first is None:
                first = now
            end = now
    assert first is not None and end is not None and num_tokens > 1
    drafts, draft_tokens, accepted = (
        a - b for a, b in zip(_spec_counters(engine), before, strict=True)
    )
    return {
        "ms_per_token": (end - first) / (num_tokens - 1) * 1000,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "drafts": drafts,
    }


def batch_throughput(engine: Engine, prompts: list[list[int]], p: SamplingParams) -> float:
    """Output tokens/s of the prompts run together."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"b{i}", prompt, p)
    num_tokens = 0
    start = time.perf_counter()
    while engine.has_unfinished():
        num_tokens += sum(len(d.token_ids) for out in engine.step() for d in out.deltas)
    return num_tokens / (time.perf_counter() - start)


def _compare(runs: int, plain_fn, spec_fn) -> tuple[list[Any], list[Any]]:
    plain, spec = [], []
    for _ in range(runs):  # alternating, so drift on a shared host hits both alike
        plain.append(plain_fn())
        spec.append(spec_fn())
    return plain, spec


def _summary(plain: list[dict], spec: list[dict]) -> dict[str, float]:
    plain_ms = statistics.median(r["ms_per_token"] for r in plain)
    spec_ms = statistics.median(r["ms_per_token"] for r in spec)
    drafts = sum(r["drafts"] for r in spec)
    draft_tokens = sum(r["draft_tokens"] for r in spec)
    accepted = sum(r["accepted_tokens"] for r in spec)
    return {
        "plain_ms_per_token": round(plain_ms, 2),
        "spec_ms_per_token": round(spec_ms, 2),
        "speedup": round(plain_ms / spec_ms, 3),
        "acceptance_rate": round(accepted / draft_tokens, 3) if draft_tokens else None,
        "tokens_per_drafted_step": round(1 + accepted / drafts, 2) if drafts else None,
    }


def engine_for(method: str, args: argparse.Namespace, **settings) -> Engine:
    config = EngineConfig(
        speculative=method,
        num_speculative_tokens=args.num_tokens,
        speculative_draft_layers=args.speculative_draft_layers,
        num_threads=args.num_threads,
        **settings,
    )
    return Engine(config, progress=False)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-tokens", type=int, default=4, help="n-gram proposals per step (K)")
    ap.add_argument("--draft-ks", default="1,2,4,6,8")
    ap.add_argument("--speculative-draft-layers", type=int, default=None)
    ap.add_argument("--batch-sizes", default="1,2,4,8")
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    results: dict[str, Any] = {"settings": vars(args).copy()}

    ngram = engine_for("ngram", args, speculative_max_num_seqs=1024)
    prompts = {name: ngram.tokenizer.encode_chat(conv) for name, conv in workloads().items()}
    single_stream(ngram, prompts["code edit"], params(8, True))  # warm-up
    print(f"1. n-gram, single stream, K={args.num_tokens}, {args.output_len} tokens out")
    results["ngram"] = {}
    for name, prompt in prompts.items():
        plain, spec = _compare(
            args.rounds,
            lambda prompt=prompt: single_stream(ngram, prompt, params(args.output_len, False)),
            lambda prompt=prompt: single_stream(ngram, prompt, params(args.output_len, True)),
        )
        results["ngram"][name] = row = _summary(plain, spec)
        print(f"   {name:12s} {row}")

    print("3. batch size: output tokens/s, code edit, n-gram vs plain")
    results["batch"] = {}
    code_edit = workloads()["code edit"][0]["content"]
    for size in [int(x) for x in args.batch_sizes.split(",")]:
        batch = [  # one request per version number: no two alike
            ngram.tokenizer.encode_chat(
                [{"role": "user", "content": f"{code_edit}\n(version {i + 1})"}]
            )
            for i in range(size)
        ]
        plain, spec = _compare(
            args.rounds,
            lambda batch=batch: batch_throughput(ngram, batch, params(args.output_len, False)),
            lambda batch=batch: batch_throughput(ngram, batch, params(args.output_len, True)),
        )
        row = {
            "plain_tokens_per_s": round(statistics.median(plain), 1),
            "spec_tokens_per_s": round(statistics.median(spec), 1),
        }
        row["speedup"] = round(row["spec_tokens_per_s"] / row["plain_tokens_per_s"], 3)
        results["batch"][size] = row
        print(f"   batch {size:3d}: {row}")

    draft = engine_for("draft", args)
    assert draft.speculator is not None
    proposer = draft.speculator.proposer
    assert isinstance(proposer, DraftProposer)
    layers = proposer.num_layers or draft.model_config.num_layers
    print(f"2. draft: the int8 twin, {layers} layers, single stream, against K")
    results["draft"] = {"layers": layers}
    for name in ("code edit", "random text"):
        results["draft"][name] = {}
        for k in [int(x) for x in args.draft_ks.split(",")]:
            draft.speculator.num_tokens = k
            plain, spec = _compare(
                args.rounds,
                lambda p=prompts[name]: single_stream(draft, p, params(args.output_len, False)),
                lambda p=prompts[name]: single_stream(draft, p, params(args.output_len, True)),
            )
            results["draft"][name][k] = row = _summary(plain, spec)
            print(f"   {name:12s} K={k}: {row}")
    print(f"wrote {write_json(args.out, results)}")
    return results


if __name__ == "__main__":
    main()
