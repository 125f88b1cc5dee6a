"""``llmserve up --prefill 1 --decode 1`` (separate processes, real NATS): a disaggregated request
gives exactly the greedy output of one in-process engine with the same weights and KV cache dtype,
in bf16 and with the int8 KV cache (whose rows carry their scales), for a 20-token prompt (its pages
in one message) and a 2,000-token one (in several: the bus's max_payload splits them). The 20-token
prompt sent again, its full block now cached on the decode executor, is prefilled there
('short_prompt'), with the same output. Afterwards both executors' free blocks are back at their
level before the requests."""

from __future__ import annotations

import math
import random
import time
from typing import Any

import httpx
import pytest
from e2e_harness import free_blocks, index_match, metric_total, wait_for

from services.cli.launcher import Stack, StackConfig
from services.cli.servers import DEFAULT_NATS_MAX_PAYLOAD
from shared.engine.kv_transfer import page_layout
from shared.engine.llm import LLM
from shared.wire.block_hash import hash_prompt_blocks
from shared.wire.kv_transport import plan_chunks
from shared.wire.sampling_params import SamplingParams

MODEL = "SmolLM2-135M-Instruct"
PREFILL, DECODE = "executor-0", "executor-1"  # launch order: prefill, then decode
BLOCK_SIZE = 16
MAX_TOKENS = 12
# Prompts with at least this many tokens not cached on the decode executor are disaggregated: the
# 20-token prompt is, until the decode executor caches its full block (16 tokens; 4 then remain).
MIN_UNCACHED_TOKENS = 8


def complete(base_url: str, prompt: list[int]) -> dict[str, Any]:
    r = httpx.post(
        f"{base_url}/v1/completions",
        json={
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
        },
        timeout=180,
    )
    assert r.status_code == 200, r.text
    return r.json()


def metrics(s: Stack) -> str:
    return httpx.get(f"{s.base_url}/metrics", timeout=30).text


def counts(s: Stack) -> dict[str, float]:
    """The disaggregation decisions and the KV transfers so far, and the prefill side's bytes and
    messages sent."""
    text = metrics(s)
    return {
        "disaggregated": metric_total(
            text, "llmserve:disaggregation_decisions_total", decision="disaggregated"
        ),
        "short_prompt": metric_total(
            text, "llmserve:disaggregation_decisions_total", decision="short_prompt"
        ),
        "sent": metric_total(text, "llmserve:kv_transfers_total", executor=PREFILL, outcome="sent"),
        "received": metric_total(
            text, "llmserve:kv_transfers_total", executor=DECODE, outcome="received"
        ),
        "bytes": metric_total(text, "llmserve:kv_transfer_bytes_total", executor=PREFILL),
        "chunks": metric_total(text, "llmserve:kv_transfer_chunks_total", executor=PREFILL),
    }


def wait_for_counts(s: Stack, expected: dict[str, float]) -> dict[str, float]:
    """Until the counts include ``expected``: every service reports its metrics each second, so
    within a few (a loaded host may delay a report by seconds)."""
    deadline = time.monotonic() + 30
    while True:
        now = counts(s)
        if expected.items() <= now.items() or time.monotonic() > deadline:
            assert expected.items() <= now.items(), (expected, now)
            return now
        time.sleep(0.5)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"], ids=["kv-bf16", "kv-int8"])
def test_a_disaggregated_request_gives_the_aggregated_greedy_output(stack, kv_cache_dtype):
    rng = random.Random(0)
    short = [rng.randrange(1000, 40000) for _ in range(20)]
    long = [rng.randrange(1000, 40000) for _ in range(2000)]
    settings: dict[str, Any] = dict(
        dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, num_kv_blocks=256, num_threads=1
    )
    # The reference: one engine with exactly the executors' engine config, greedy, alone.
    llm = LLM(StackConfig.of(**settings).engine, progress=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = {len(p): llm.generate([p], greedy)[0].outputs[0].text for p in (short, long)}
    page_nbytes = page_layout(llm.engine.kv_cache).page_nbytes
    del llm

    s = stack(
        **settings,
        num_executors=0,
        num_prefill=1,
        num_decode=1,
        disagg_min_uncached_tokens=MIN_UNCACHED_TOKENS,
        # A loaded host must not turn a slow transfer into a local decode (the same text, but no
        # 'sent'/'received'): far above any transfer's time here.
        kv_transfer_timeout_s=60.0,
    )
    # Ready means the scheduler has heard both executors (else it would prefill locally:
    # 'no_prefill_executor').
    before = free_blocks(s)

    # 20 tokens: 2 pages (one full block, one partial) in one message.
    body = complete(s.base_url, short)
    assert body["choices"][0]["text"] == expected[20]
    assert body["usage"]["completion_tokens"] == MAX_TOKENS
    after_short = wait_for_counts(s, {"disaggregated": 1, "sent": 1, "received": 1})
    assert after_short["chunks"] == 1 and after_short["bytes"] == 2 * page_nbytes, after_short

    # 2,000 tokens: 125 pages, more than one message may carry.
    body = complete(s.base_url, long)
    assert body["choices"][0]["text"] == expected[2000]
    now = wait_for_counts(s, {"disaggregated": 2, "sent": 2, "received": 2})
    num_pages = math.ceil(len(long) / BLOCK_SIZE)
    num_chunks = len(plan_chunks(num_pages, page_nbytes, DEFAULT_NATS_MAX_PAYLOAD))
    assert num_chunks >= 2
    assert now["chunks"] - after_short["chunks"] == num_chunks, now
    assert now["bytes"] - after_short["bytes"] == num_pages * page_nbytes, now

    # 20 tokens again: the decode executor holds the full block it was sent, in its prefix cache
    # (the index learns it from its KV events); 4 tokens are left to prefill: locally.
    [block_hash] = hash_prompt_blocks(short, BLOCK_SIZE)
    wait_for(
        lambda: (index_match(s, MODEL, [block_hash]) or {}).get(DECODE, 0) == 1,
        30,
        "the index to know the decode executor's cached block",
    )
    body = complete(s.base_url, short)
    assert body["choices"][0]["text"] == expected[20]
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == BLOCK_SIZE
    now = wait_for_counts(s, {"disaggregated": 2, "short_prompt": 1, "sent": 2, "received": 2})
    print(f"{kv_cache_dtype} KV cache: {num_chunks} messages for 2,000 tokens; {now}")

    # Every block is back on both sides (cached ones count as free: evictable).
    wait_for(lambda: free_blocks(s) == before, 30, f"both executors' free blocks back at {before}")
