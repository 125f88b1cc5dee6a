"""The executor's memory ledger for its heartbeat: what ``llmserve plan`` promises for its settings
next to what the loaded engine holds (shared/engine/memory.py is the one formula for both)."""

from __future__ import annotations

import os
from typing import Protocol

import msgspec

from shared.engine.config import EngineConfig
from shared.engine.memory import InsufficientMemoryError, MemoryLedger, parse_bytes, plan_memory
from shared.engine.models.config import ModelConfig
from shared.engine.models.known_configs import resolve_model
from shared.engine.quantization import kv_dtype_name
from shared.wire.messages import ExecutorMemory


class LoadedEngine(Protocol):
    """What the ledger needs of an Engine, after its load."""

    config: EngineConfig
    model_config: ModelConfig
    max_model_len: int

    def resident_weight_bytes(self) -> int: ...
    def kv_cache_bytes(self) -> int: ...
    def num_kv_blocks(self) -> int: ...


def planned_ledger(
    config: EngineConfig, model_config: ModelConfig, max_model_len: int
) -> MemoryLedger | None:
    """``llmserve plan`` for these settings (weights from the parameter count); None when the pool
    was sized by a block count (no budget) or the budget cannot hold the plan."""
    if config.num_kv_blocks is not None:
        return None
    # gguf's weight bytes depend on each linear's block format in the file: read from its header.
    resolved = resolve_model(config.model) if config.quantization == "gguf" else None
    try:
        return plan_memory(
            model_config,
            memory_budget_bytes=parse_bytes(config.memory_budget),
            weight_dtype=config.dtype,
            kv_dtype=kv_dtype_name(config.kv_cache_dtype, config.dtype),
            block_size=config.block_size,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            context_len=max_model_len,
            quantization=config.quantization,
            gguf_formats=None if resolved is None else resolved.gguf_formats,
            gguf_head_format=None if resolved is None else resolved.gguf_head_format,
        )
    except InsufficientMemoryError:
        return None


def memory_status(engine: LoadedEngine) -> ExecutorMemory:
    config = engine.config
    plan = planned_ledger(config, engine.model_config, engine.max_model_len)
    num_blocks = engine.num_kv_blocks()
    return ExecutorMemory(
        memory_budget_bytes=plan.memory_budget_bytes if plan is not None else 0,
        weight_dtype=config.dtype,
        kv_dtype=kv_dtype_name(config.kv_cache_dtype, config.dtype),
        planned_weight_bytes=plan.weight_bytes if plan is not None else 0,
        planned_activation_bytes=plan.activation_bytes if plan is not None else 0,
        planned_kv_cache_bytes=plan.kv_cache_bytes if plan is not None else 0,
        planned_num_kv_blocks=plan.num_kv_blocks if plan is not None else 0,
        weight_bytes=engine.resident_weight_bytes(),
        kv_cache_bytes=engine.kv_cache_bytes(),
        num_kv_blocks=num_blocks,
        kv_bytes_per_block=engine.kv_cache_bytes() // max(num_blocks, 1),
        max_num_batched_tokens=config.max_num_batched_tokens,
    )


def with_rss(memory: ExecutorMemory) -> ExecutorMemory:
    """``memory`` with the process's resident memory now (Linux /proc; 0 elsewhere)."""
    return msgspec.structs.replace(memory, process_rss_bytes=process_rss_bytes())


def process_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            resident_pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return resident_pages * os.sysconf("SC_PAGE_SIZE")
