"""Greedy generation through the paged runtime, the way the engine drives it: one prefill
(optionally chunked) through ``ScheduledChunk``s, then one token per step, against a block table of
distinct non-zero block ids (block 0 is padding and must never be written)."""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass, field

import torch

from shared.engine.cpu_backend import CpuBackend
from shared.engine.kv_cache import KVCache
from shared.engine.model_runner import ModelRunner, ScheduledChunk
from shared.engine.models import teacher_forcing
from shared.engine.models.llama import LlamaModel
from shared.engine.models.runtime import ModelRuntime

BLOCK_SIZE = 16


def blocks_needed(num_tokens: int, block_size: int = BLOCK_SIZE) -> int:
    return -(-num_tokens // block_size)


def make_runner(
    model: ModelRuntime | LlamaModel,
    num_blocks: int,
    block_size: int = BLOCK_SIZE,
    kv_cache_dtype: str = "auto",
) -> ModelRunner:
    """A runner over a fresh, zeroed KV cache in the model's dtype (or int8)."""
    return ModelRunner(
        model,
        KVCache(model.config, num_blocks, block_size, model.dtype, kv_cache_dtype=kv_cache_dtype),
    )


def shuffled_block_table(
    num_blocks_needed: int,
    num_blocks_in_cache: int,
    rng: random.Random | None = None,
    exclude: set[int] | None = None,
) -> list[int]:
    """Distinct, non-zero, non-contiguous block ids in random order (never block 0)."""
    rng = rng or random.Random(0)
    pool = [b for b in range(1, num_blocks_in_cache) if not exclude or b not in exclude]
    if len(pool) < num_blocks_needed:
        raise ValueError(
            f"cache of {num_blocks_in_cache} blocks cannot give {num_blocks_needed} free blocks"
        )
    return rng.sample(pool, num_blocks_needed)


@dataclass
class GreedyResult:
    token_ids: list[int]  # new tokens only
    logits: list[torch.Tensor] = field(default_factory=list)  # fp32 [vocab] per step, if kept


def greedy_generate(
    model: ModelRuntime | LlamaModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    chunk_size: int | None = None,
    block_size: int = BLOCK_SIZE,
    seed: int = 0,
    keep_logits: bool = False,
    stop_token_ids: tuple[int, ...] = (),
) -> GreedyResult:
    """Greedy decode of ``max_new_tokens`` (fewer if a stop token is produced; it is kept).

    The cache has a few spare blocks so the shuffled table is genuinely scattered."""
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    total = len(prompt_ids) + max_new_tokens
    needed = blocks_needed(total, block_size)
    runner = make_runner(model, num_blocks=2 * needed + 3, block_size=block_size)
    table = shuffled_block_table(needed, runner.kv_cache.num_blocks, random.Random(seed))

    chunk = chunk_size or len(prompt_ids)
    logits = None
    for start in range(0, len(prompt_ids), chunk):
        ids = prompt_ids[start : start + chunk]
        last = start + len(ids) == len(prompt_ids)
        out = runner.execute([ScheduledChunk(ids, start, table, need_logits=last)])
        if last:
            logits = out[0]
    result = GreedyResult([])
    position = len(prompt_ids)
    while True:
        assert logits is not None
        if keep_logits:
            result.logits.append(logits.clone())
        token = int(torch.argmax(logits))
        result.token_ids.append(token)
        if len(result.token_ids) == max_new_tokens or token in stop_token_ids:
            break
        logits = runner.execute([ScheduledChunk([token], position, table)])[0]
        position += 1
    # Block 0 is padding: nothing may ever be written to it.
    assert not runner.kv_cache.storage[:, :, 0].any(), "block 0 (padding) was written"
    return result


def all_position_logits(
    model: ModelRuntime | LlamaModel,
    token_ids: list[int],
    block_size: int = BLOCK_SIZE,
    seed: int = 0,
    kv_cache_dtype: str = "auto",
) -> torch.Tensor:
    """fp32 logits [len(token_ids), vocab] at every position of one paged prefill (teacher forcing),
    over a scattered block table: row i is the distribution of the token
    after ``token_ids[:i + 1]``."""
    needed = blocks_needed(len(token_ids), block_size)
    num_blocks = 2 * needed + 3
    table = shuffled_block_table(needed, num_blocks, random.Random(seed))
    return teacher_forcing.all_position_logits(
        model,
        token_ids,
        table,
        block_size=block_size,
        num_blocks=num_blocks,
        kv_cache_dtype=kv_cache_dtype,
    )


@contextlib.contextmanager
def torch_path(runtime: ModelRuntime, off: bool = True):
    """The runtime on the plain torch path for the block (``off=False``: as it is), then back on its
    backend."""
    backend = runtime.backend
    if off:
        runtime.use(CpuBackend.off("the torch path, for comparison"))
    try:
        yield runtime
    finally:
        if off:
            runtime.use(backend)


# The batches mixed_batch_logits pools. In bf16 a batch's distance from the fp32 logits is the
# drift of its three sequences (last-bit differences amplified over 30 layers), so between two paths
# that round in different places the ratio of their distances swings 0.5-1.8 from one batch to the
# next (on an AVX2-only CPU, over 16 batches); pooled over six it stays within 0.8-1.2.
POOLED_SEEDS = tuple(range(5, 11))


def mixed_batch_logits(
    model: ModelRuntime, fused: bool, kv_cache_dtype: str = "auto"
) -> torch.Tensor:
    """Per seed of POOLED_SEEDS, a batch of random token ids over a fresh cache: two sequences
    decoding over cached context plus a fresh prefill chunk, in one forward; then a decode-only step
    of all three (``fused=False``: on the plain torch path). The batches' logits, stacked."""
    with torch_path(model, off=not fused):
        return torch.cat(
            [_mixed_batch_logits(model, kv_cache_dtype, seed) for seed in POOLED_SEEDS]
        )


def _mixed_batch_logits(model: ModelRuntime, kv_cache_dtype: str, seed: int) -> torch.Tensor:
    runner = make_runner(model, 64, kv_cache_dtype=kv_cache_dtype)
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (70, 33, 40)]
    tables = [list(range(1, 6)), list(range(6, 9)), list(range(9, 12))]
    runner.execute(
        [ScheduledChunk(ids[0][:69], 0, tables[0]), ScheduledChunk(ids[1][:32], 0, tables[1])]
    )
    mixed = runner.execute(
        [
            ScheduledChunk(ids[0][69:], 69, tables[0]),
            ScheduledChunk(ids[2], 0, tables[2]),
            ScheduledChunk(ids[1][32:], 32, tables[1]),
        ]
    )
    decode = runner.execute(
        [
            ScheduledChunk([7], 70, tables[0]),
            ScheduledChunk([8], 40, tables[2]),
            ScheduledChunk([9], 33, tables[1]),
        ]
    )
    return torch.cat([mixed, decode])


def assert_fused_as_close(
    fused: torch.Tensor,
    plain: torch.Tensor,
    ref: torch.Tensor,
    quantizing: torch.Tensor | None = None,
) -> None:
    """bf16 logits of the fused path (``fused``) and the torch path (``plain``), from
    mixed_batch_logits: the two round in different places, so each is held to its distance from the
    fp32 logits ``ref`` on the same cache dtype. The fused path's mean distance stays within 1.6x
    the torch path's; its largest within twice the torch path's largest plus the most quantizing the
    cache moves a logit (``quantizing``: |fp32 logits on the quantized cache - on an fp32 cache|;
    none for a bf16 cache). The largest is a few sequences' drift: pooled over POOLED_SEEDS its
    ratio still read 0.7-1.7 from one set of seeds to the next, the mean's 0.8-1.2."""
    err_fused, err_plain = (fused - ref).abs(), (plain - ref).abs()
    slack = 0.0 if quantizing is None else quantizing.max().item()
    print(
        f"bf16 |logit - fp32| mean/max: fused {err_fused.mean():.3g}/{err_fused.max():.3g}, "
        f"torch path {err_plain.mean():.3g}/{err_plain.max():.3g}"
    )
    assert err_fused.mean() <= 1.6 * err_plain.mean()
    assert err_fused.max() <= 2 * err_plain.max() + slack


def assert_quantized_cache_paths_close(
    runtime_fp32: ModelRuntime, runtime_bf16: ModelRuntime, kv_cache_dtype: str
) -> None:
    """The fused path on a quantized cache (``kv_cache_dtype``: int8 or fp8) against the torch
    reference on the same cache. Rounding to the cache dtype is a step function that last-bit
    differences between the paths flip to the next step, so in fp32 the paths are held to a
    fraction of what quantizing costs (|fp32 logits on the quantized cache - on an fp32 cache|):
    their mean distance within 0.8x its mean, their largest within 1.2x its largest. In bf16 both
    paths are held to their distance from the fp32 reference on the quantized cache
    (assert_fused_as_close)."""
    exact = mixed_batch_logits(runtime_fp32, False, "auto")
    ref = mixed_batch_logits(runtime_fp32, False, kv_cache_dtype)
    paths, quantizing = (
        (mixed_batch_logits(runtime_fp32, True, kv_cache_dtype) - ref).abs(),
        (ref - exact).abs(),
    )
    assert paths.mean() <= 0.8 * quantizing.mean() and paths.max() <= 1.2 * quantizing.max()
    assert_fused_as_close(
        mixed_batch_logits(runtime_bf16, True, kv_cache_dtype),
        mixed_batch_logits(runtime_bf16, False, kv_cache_dtype),
        ref,
        quantizing,
    )
