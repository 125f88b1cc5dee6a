"""KV-cache utilization accounting: paged blocks vs contiguous per-request reservations (pure
logic).

At every engine step (sampled just before the forward pass, when this step's blocks are allocated)
one ``KVSample`` records, over the running sequences:

- ``live_tokens``: tokens whose K/V sit in the cache once this step's forward has written them
  (``num_computed_tokens`` + the tokens scheduled now);
- ``paged_reserved``: slots the block manager has handed out (used blocks x block_size);
- ``contiguous_reserved[name]``: what a contiguous allocator would hold for the same running set
  when it reserves a fixed maximum per request at admission (e.g. prompt + max_tokens, or
  max_model_len).

Utilization = live / reserved. Two averages are reported: the mean of the per-step ratios ("step
mean") and the ratio of sums over all steps ("slot-weighted", i.e. weighted by how much was
reserved).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["KVSample", "summarize_kv"]


@dataclass(frozen=True)
class KVSample:
    live_tokens: int
    paged_reserved: int
    contiguous_reserved: dict[str, int] = field(default_factory=dict)


def _stats(live: Sequence[int], reserved: Sequence[int]) -> dict[str, float | int]:
    ratios = [lv / r for lv, r in zip(live, reserved, strict=True) if r > 0]
    peak_step = max(range(len(reserved)), key=lambda i: reserved[i])
    return {
        "util_step_mean": sum(ratios) / len(ratios),
        "util_slot_weighted": sum(live) / sum(reserved),
        "util_min": min(ratios),
        "util_at_peak_reserved": live[peak_step] / reserved[peak_step],
        "peak_reserved_slots": reserved[peak_step],
        "mean_reserved_slots": sum(reserved) / len(reserved),
    }


def summarize_kv(samples: Sequence[KVSample]) -> dict:
    """Per scheme (``paged`` and each contiguous variant): utilization stats; plus live-token peaks
    and each contiguous variant's mean reservation relative to paged (how many times more
    memory)."""
    samples = [s for s in samples if s.paged_reserved > 0]
    if not samples:
        raise ValueError("no engine step held any KV blocks")
    live = [s.live_tokens for s in samples]
    out: dict = {
        "num_steps": len(samples),
        "peak_live_tokens": max(live),
        "mean_live_tokens": sum(live) / len(live),
        "paged": _stats(live, [s.paged_reserved for s in samples]),
        "contiguous": {},
    }
    paged_mean = out["paged"]["mean_reserved_slots"]
    for name in samples[0].contiguous_reserved:
        stats = _stats(live, [s.contiguous_reserved[name] for s in samples])
        stats["mean_reserved_vs_paged"] = stats["mean_reserved_slots"] / paged_mean
        out["contiguous"][name] = stats
    return out
