"""What the console shows, as one JSON object (``GET /console/api/state``), assembled from what the
gateway holds: the executors' latest heartbeats (executor_board.py), the scheduler's and the prefix
index's status (asked for this call; an error string when one did not answer), and its table of
recent requests (request_log.py). Pure: every input is passed in.

Per executor (its heartbeat is the source; the scheduler's view adds what it routed there)::

    kv          blocks: total (usable), used, free, cached (holding a prefix hash, in use or not),
                usage in [0, 1]
    memory      the ledger: budget, weights / activations / KV cache planned vs actual, the
                process's resident memory (null: an executor that does not report it)
    batch       running, waiting, preemptions, tokens in the last step, tokens per step and
                generated tokens per second between its last two heartbeats
    prefix      cache queries and hits in tokens, hit rate (null before any query)
"""

from __future__ import annotations

from typing import Any

import msgspec

from shared.wire.messages import ExecutorMemory, PrefixIndexStatus, SchedulerStatus

from .executor_board import Sighting
from .request_log import RequestRecord


def console_state(
    *,
    now: float,
    wall_time: float,
    gateway: dict[str, Any],
    executors: list[Sighting],
    scheduler: SchedulerStatus | str | None,
    prefix_index: PrefixIndexStatus | str | None,
    requests: list[RequestRecord],
) -> dict[str, Any]:
    routed = (
        {e.executor_id: e for e in scheduler.executors}
        if isinstance(scheduler, SchedulerStatus)
        else {}
    )
    return {
        "time": wall_time,
        "gateway": gateway,
        "executors": [_executor(s, now, routed.get(s.heartbeat.executor_id)) for s in executors],
        "scheduler": _status(scheduler, drop=("executors",)),
        "prefix_index": _status(prefix_index),
        "requests": [r.as_json(now) for r in requests],
    }


def _status(answer: msgspec.Struct | str | None, drop: tuple[str, ...] = ()) -> dict[str, Any]:
    if answer is None:
        return {"available": False, "error": "not running"}
    if isinstance(answer, str):
        return {"available": False, "error": answer}
    fields = {k: v for k, v in msgspec.structs.asdict(answer).items() if k not in drop}
    return {"available": True, **fields}


def _executor(s: Sighting, now: float, routed: Any) -> dict[str, Any]:
    hb = s.heartbeat
    st = hb.stats
    used = st.num_total_blocks - st.num_free_blocks
    rates: dict[str, float | None] = {"tokens_per_step": None, "generated_tokens_per_s": None}
    if s.previous is not None and s.previous_received is not None:
        p = s.previous.stats
        num_steps = st.num_steps - p.num_steps
        if num_steps > 0:
            rates["tokens_per_step"] = (st.num_computed_tokens - p.num_computed_tokens) / num_steps
        elapsed = hb.sent_at - s.previous.sent_at
        if elapsed > 0:
            rates["generated_tokens_per_s"] = (
                st.num_generated_tokens - p.num_generated_tokens
            ) / elapsed
    queries = st.prefix_cache_queries_tokens
    return {
        "executor_id": hb.executor_id,
        "epoch": hb.epoch,
        "role": hb.role,
        "model": hb.model,
        "draining": hb.draining,
        "heartbeat_age_s": now - s.received,
        "block_size": hb.block_size,
        "max_model_len": hb.max_model_len,
        "max_num_seqs": hb.max_num_seqs,
        "kv": {
            "num_total_blocks": st.num_total_blocks,
            "num_used_blocks": used,
            "num_free_blocks": st.num_free_blocks,
            "num_cached_blocks": st.num_cached_blocks,
            "usage": st.kv_cache_usage,
        },
        "memory": _memory(hb.memory),
        "batch": {
            "num_running": st.num_running,
            "num_waiting": st.num_waiting,
            "num_preemptions": st.num_preemptions,
            "num_steps": st.num_steps,
            "last_step_num_tokens": st.last_step_num_tokens,
            "last_step_num_seqs": st.last_step_num_seqs,
            "num_generated_tokens": st.num_generated_tokens,
            **rates,
        },
        "prefix_cache": {
            "queries_tokens": queries,
            "hits_tokens": st.prefix_cache_hits_tokens,
            "hit_rate": st.prefix_cache_hits_tokens / queries if queries else None,
        },
        "load": msgspec.structs.asdict(hb.load) if hb.load is not None else None,
        "scheduler_view": (
            {
                "num_in_flight": routed.num_in_flight,
                "load_estimate": routed.load_estimate,
                "capacity": routed.capacity,
            }
            if routed is not None
            else None
        ),
    }


def _memory(m: ExecutorMemory | None) -> dict[str, Any] | None:
    if m is None:
        return None
    planned_total = m.planned_weight_bytes + m.planned_activation_bytes + m.planned_kv_cache_bytes
    return {
        "budget_bytes": m.memory_budget_bytes,
        "weight_dtype": m.weight_dtype,
        "kv_dtype": m.kv_dtype,
        "kv_bytes_per_block": m.kv_bytes_per_block,
        "process_rss_bytes": m.process_rss_bytes,
        "max_num_batched_tokens": m.max_num_batched_tokens,
        # planned: `llmserve plan` for its settings (0 when its pool was sized by a block count);
        # actual: held by the engine. Activations are transient: planned only.
        "rows": [
            {"item": "weights", "planned": m.planned_weight_bytes, "actual": m.weight_bytes},
            {"item": "activations", "planned": m.planned_activation_bytes, "actual": None},
            {"item": "kv cache", "planned": m.planned_kv_cache_bytes, "actual": m.kv_cache_bytes},
        ],
        "planned_total_bytes": planned_total,
        "num_kv_blocks": m.num_kv_blocks,
        "planned_num_kv_blocks": m.planned_num_kv_blocks,
    }
