"""Engine stats for tests that play an executor: an idle engine's, with what the test sets."""

from __future__ import annotations

from typing import Any

from shared.wire.outputs import EngineStats

_IDLE: dict[str, Any] = {
    "num_running": 0,
    "num_waiting": 0,
    "num_total_blocks": 100,
    "num_free_blocks": 100,
    "kv_cache_usage": 0.0,
    "prefix_cache_queries_tokens": 0,
    "prefix_cache_hits_tokens": 0,
    "num_preemptions": 0,
    "num_prompt_tokens": 0,
    "num_computed_tokens": 0,
    "num_generated_tokens": 0,
    "num_steps": 0,
    "last_step_num_tokens": 0,
}


def engine_stats(**fields: Any) -> EngineStats:
    """``EngineStats`` of an idle engine with 100 free blocks, ``fields`` replacing its values."""
    return EngineStats(**{**_IDLE, **fields})
