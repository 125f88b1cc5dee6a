"""Prefill in engine A, move the pages, decode in engine B: exactly the tokens of one engine, on
the tiny random Llama (fp32, int8 and fp8 KV caches) and on SmolLM2 (bf16, and the int8 KV cache),
and no block leaked on either side."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest

from helpers.tiny_llama import TINY_VOCAB, save_tiny_llama
from shared.engine import kv_transfer
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.wire.block_hash import hash_prompt_blocks
from shared.wire.outputs import RequestOutput
from shared.wire.sampling_params import SamplingParams


def _tokens_until_done(engine: Engine, rid: str, got: list[int]) -> list[int]:
    while rid in engine.requests:
        for out in engine.step():
            if out.request_id == rid:
                got += out.deltas[0].token_ids
    return got


def run_aggregated(engine: Engine, rid: str, prompt: list[int], params: SamplingParams):
    engine.add_request(rid, prompt, params)
    return _tokens_until_done(engine, rid, [])


def prefill_until_first_token(engine: Engine, rid: str, prompt: list[int], params) -> list[int]:
    engine.add_request(
        rid, prompt, params, block_hashes=hash_prompt_blocks(prompt, engine.config.block_size)
    )
    outputs: list[RequestOutput] = []
    while not outputs:
        outputs = [o for o in engine.step() if o.request_id == rid]
    assert not outputs[0].finished
    return list(outputs[0].deltas[0].token_ids)


def move(a: Engine, b: Engine, rid: str) -> tuple[kv_transfer.Reservation, int]:
    """Detach from A, reserve and install in B, release A: the number of pages sent."""
    detached = kv_transfer.detach(a, rid)
    reservation = kv_transfer.reserve(b, detached.handoff)
    assert reservation is not None
    to_send = detached.block_ids[reservation.num_cached_blocks :]
    pages = kv_transfer.read_pages(a.kv_cache, to_send)
    assert pages.shape == (len(to_send), kv_transfer.page_layout(a.kv_cache).page_nbytes)
    kv_transfer.write_pages(b.kv_cache, reservation.missing_block_ids, pages.numpy().tobytes())
    kv_transfer.release(a, detached)
    kv_transfer.commit(b, reservation)
    return reservation, len(to_send)


def run_disaggregated(a: Engine, b: Engine, rid: str, prompt: list[int], params) -> list[int]:
    got = prefill_until_first_token(a, rid, prompt, params)
    move(a, b, rid)
    return _tokens_until_done(b, rid, got)


def assert_free(engine: Engine, num_free: int) -> None:
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_blocks == num_free
    assert not engine.requests


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"), seed=5)


def tiny_engine(path: str, **kw: Any) -> Engine:
    config: dict[str, Any] = dict(
        model=path,
        dtype="float32",
        num_kv_blocks=64,
        block_size=4,
        max_num_batched_tokens=32,
        num_threads=1,
    )
    return Engine(EngineConfig(**(config | kw)), progress=False)


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [0] + [rng.randrange(2, TINY_VOCAB) for _ in range(n - 1)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8"])
@pytest.mark.parametrize("num_prompt", [5, 8, 70])
def test_tiny_disaggregated_matches_one_engine(tiny_dir, num_prompt, kv_cache_dtype):
    """Chunked prefill (70 > the 32-token budget), a partly filled last block and a full one."""
    ref, a, b = (tiny_engine(tiny_dir, kv_cache_dtype=kv_cache_dtype) for _ in range(3))
    prompt = _prompt(num_prompt)
    expected = run_aggregated(ref, "r", prompt, GREEDY)
    free_a, free_b = a.stats().num_free_blocks, b.stats().num_free_blocks
    assert run_disaggregated(a, b, "r", prompt, GREEDY) == expected
    assert len(expected) == 24
    assert_free(a, free_a)
    assert_free(b, free_b)


def test_decode_side_prefix_hits_are_not_sent(tiny_dir):
    ref, a, b = (tiny_engine(tiny_dir) for _ in range(3))
    shared = _prompt(40, seed=1)
    prompt = shared + _prompt(13, seed=2)[1:]
    # B already computed the shared prefix (10 blocks of 4) for an earlier request.
    run_aggregated(b, "earlier", shared + [7], GREEDY)
    expected = run_aggregated(ref, "r", prompt, GREEDY)
    got = prefill_until_first_token(a, "r", prompt, GREEDY)
    reservation, num_sent = move(a, b, "r")
    assert reservation.num_cached_blocks == 10
    assert num_sent == -(-len(prompt) // 4) - 10
    assert _tokens_until_done(b, "r", got) == expected
    assert b.stats().prefix_cache_hits_tokens >= 40


def test_seeded_sampling_continues_the_same_random_stream(tiny_dir):
    ref, a, b = (tiny_engine(tiny_dir) for _ in range(3))
    params = SamplingParams(
        temperature=1.0,
        top_p=0.9,
        seed=1234,
        max_tokens=20,
        ignore_eos=True,
        repetition_penalty=1.3,
    )
    prompt = _prompt(30, seed=3)
    expected = run_aggregated(ref, "r", prompt, params)
    assert run_disaggregated(a, b, "r", prompt, params) == expected


def test_readopt_decodes_on_the_prefill_side_unchanged(tiny_dir):
    ref, a = tiny_engine(tiny_dir), tiny_engine(tiny_dir)
    prompt = _prompt(23, seed=4)
    expected = run_aggregated(ref, "r", prompt, GREEDY)
    free_a = a.stats().num_free_blocks
    got = prefill_until_first_token(a, "r", prompt, GREEDY)
    detached = kv_transfer.detach(a, "r")
    assert a.stats().num_free_blocks == free_a - len(detached.block_ids)  # held, not freed
    kv_transfer.readopt(a, detached)
    # It decodes from the held pages: its next step runs the first token alone (a prompt computed
    # again would run 24 tokens there).
    got += [t for out in a.step() if out.request_id == "r" for t in out.deltas[0].token_ids]
    assert a.stats().last_step_num_tokens == 1
    assert _tokens_until_done(a, "r", got) == expected
    assert_free(a, free_a)


def test_recompute_on_the_decode_side_when_pages_never_come(tiny_dir):
    ref, a, b = (tiny_engine(tiny_dir) for _ in range(3))
    prompt = _prompt(37, seed=6)
    expected = run_aggregated(ref, "r", prompt, GREEDY)
    free_a, free_b = a.stats().num_free_blocks, b.stats().num_free_blocks
    got = prefill_until_first_token(a, "r", prompt, GREEDY)
    detached = kv_transfer.detach(a, "r")
    reservation = kv_transfer.reserve(b, detached.handoff)
    assert reservation is not None
    kv_transfer.release(a, detached)  # the prefill side is gone
    kv_transfer.recompute(b, reservation)
    assert _tokens_until_done(b, "r", got) == expected
    assert_free(a, free_a)
    assert_free(b, free_b)


def test_reserve_refuses_when_the_pool_is_short_and_cancel_frees(tiny_dir):
    a = tiny_engine(tiny_dir)
    b = tiny_engine(tiny_dir, num_kv_blocks=25)  # 24 usable; the prompt needs 15
    prompt = _prompt(60, seed=7)
    prefill_until_first_token(a, "r", prompt, GREEDY)
    detached = kv_transfer.detach(a, "r")
    free_b = b.stats().num_free_blocks
    first = kv_transfer.reserve(b, detached.handoff)
    assert first is not None and first.num_cached_blocks == 0
    assert b.stats().num_free_blocks == free_b - 15
    other = dataclasses.replace(detached.handoff, request_id="other")
    assert kv_transfer.reserve(b, other) is None  # reserved blocks are not cached: no hits
    assert b.stats().num_free_blocks == free_b - 15  # a refusal changes nothing
    kv_transfer.cancel(b, first)
    kv_transfer.release(a, detached)
    assert_free(b, free_b)


def test_layout_and_page_bytes(tiny_dir):
    e = tiny_engine(tiny_dir)
    layout = kv_transfer.page_layout(e.kv_cache)
    # 2 layers x (K, V) x 4 tokens x 2 KV heads x head_dim 16 x 4 bytes
    assert layout.page_nbytes == 2 * 2 * 4 * 2 * 16 * 4
    e8 = tiny_engine(tiny_dir, kv_cache_dtype="int8")
    assert kv_transfer.page_layout(e8.kv_cache).page_nbytes == 2 * 2 * 4 * 2 * (16 + 4)
    fp8 = kv_transfer.page_layout(tiny_engine(tiny_dir, kv_cache_dtype="fp8").kv_cache)
    # the same bytes as int8, but not the same layout: pages never cross between the two
    assert fp8.page_nbytes == 2 * 2 * 4 * 2 * (16 + 4) and fp8.dtype == "uint8"
    assert fp8 != kv_transfer.page_layout(e8.kv_cache)


# ---- the real SmolLM2 ----------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["auto", "int8"])
def smol_engines(request) -> tuple[Engine, Engine, Engine]:
    config = EngineConfig(
        dtype="bfloat16",
        kv_cache_dtype=request.param,
        num_kv_blocks=300,
        max_num_batched_tokens=512,
        num_threads=1,
    )
    return tuple(Engine(config, progress=False) for _ in range(3))  # type: ignore[return-value]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("num_prompt", [20, 2000])
def test_smollm2_disaggregated_matches_one_engine(smol_engines, num_prompt):
    ref, a, b = smol_engines
    rng = random.Random(num_prompt)
    vocab = ref.model_config.vocab_size
    prompt = [1] + [rng.randrange(100, vocab) for _ in range(num_prompt - 1)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    rid = f"smol-{num_prompt}"
    expected = run_aggregated(ref, rid, prompt, params)
    free_a, free_b = a.stats().num_free_blocks, b.stats().num_free_blocks
    assert run_disaggregated(a, b, rid, prompt, params) == expected
    assert_free(a, free_a)
    assert_free(b, free_b)
