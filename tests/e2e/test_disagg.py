"""``llmserve up`` with one prefill and one decode executor (separate processes, real NATS): a long
prompt is prefilled on the prefill executor and decoded on the decode executor with the greedy
tokens a single engine gives; a short one is prefilled where it decodes."""

from __future__ import annotations

import random
import time

import httpx
import pytest
from e2e_harness import scheduler_status, wait_for

from shared.engine.config import EngineConfig
from shared.engine.llm import LLM
from shared.wire.sampling_params import SamplingParams


def complete(base_url: str, prompt: list[int], max_tokens: int) -> dict:
    r = httpx.post(
        f"{base_url}/v1/completions",
        json={
            "model": "SmolLM2-135M-Instruct",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
        timeout=180,
    )
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.timeout(600)
def test_a_long_prompt_is_disaggregated_with_the_same_output(stack):
    rng = random.Random(0)
    long_prompt = [rng.randrange(1000, 40000) for _ in range(600)]
    llm = LLM(EngineConfig(dtype="float32", num_kv_blocks=128), progress=False)
    expected = llm.generate(
        [long_prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    )[0]
    # A loaded host must not turn a slow transfer into a local decode (which gives the same text
    # but no 'sent'/'received'): the handoff's timeout here is far above any transfer's time.
    s = stack(
        num_executors=0,
        num_prefill=1,
        num_decode=1,
        num_prefix_indexes=0,
        kv_transfer_timeout_s=60.0,
    )
    # The stack is ready once one executor of the model is live; the scheduler must have heard
    # both, or it prefills locally ('no_prefill_executor') and nothing is transferred.
    wait_for(lambda: len(scheduler_status(s).executors) == 2, 60, "both executors' heartbeats")
    body = complete(s.base_url, long_prompt, 8)
    assert body["choices"][0]["text"] == expected.outputs[0].text
    # Every service reports its metrics each second: the last transfer's within a few (a loaded
    # host may delay a report by seconds).
    deadline = time.monotonic() + 30
    while True:
        metrics = httpx.get(f"{s.base_url}/metrics", timeout=30).text
        wanted = (
            'llmserve:disaggregation_decisions_total{decision="disaggregated"',
            'outcome="sent"',
            'outcome="received"',
        )
        if all(w in metrics for w in wanted) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    # On failure: which decision and which transfer outcome (timeout, refused, peer_gone...) it was.
    assert all(w in metrics for w in wanted), "\n".join(
        line
        for line in metrics.splitlines()
        if line.startswith(("llmserve:disaggregation_decisions", "llmserve:kv_transfers_total"))
    )
