"""Paged KV vs contiguous reservation: how much of the reserved KV memory holds live tokens, and
how many requests of the trace fit at once in a fixed pool.

Utilization comes from ``mix.py``'s run (a ``KVSample`` before every forward pass of the
continuous run: the block manager's real allocation vs what a contiguous allocator would hold for
the same running set). Concurrency at fixed memory is arithmetic on the trace's footprints and
the engine's real pool size (``max_concurrency`` below, pure)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from loadtests.report import mix
from loadtests.report.model import MEASURED, Figure, Section, Series, Table

KEY = "paged_kv"


def paged_concurrency(pool_blocks: int, footprints: Sequence[int], block_size: int) -> int:
    """Requests admitted in trace order (cycling through it) until their whole footprints, each
    rounded up to whole blocks, no longer fit in ``pool_blocks`` usable blocks."""
    if not footprints:
        return 0
    used = count = 0
    while True:
        need = math.ceil(footprints[count % len(footprints)] / block_size)
        if used + need > pool_blocks:
            return count
        used += need
        count += 1


def contiguous_concurrency(pool_tokens: int, reservations: Sequence[int]) -> int:
    """Requests admitted in trace order (cycling) while each one's fixed reservation fits."""
    if not reservations:
        return 0
    used = count = 0
    while used + reservations[count % len(reservations)] <= pool_tokens:
        used += reservations[count % len(reservations)]
        count += 1
    return count


def concurrency_at_fixed_memory(trace: dict[str, Any]) -> dict[str, int]:
    """Per scheme: requests of the trace that fit at once in the engine's usable pool, each at its
    final length (prompt + max_tokens: the most it will ever hold)."""
    bs = trace["block_size"]
    pool_blocks = trace["num_kv_blocks"] - 1  # block 0 is padding
    lens = [p + m for p, m in zip(trace["prompt_lens"], trace["max_tokens"], strict=True)]
    longest_out = max(trace["max_tokens"])
    return {
        "paged (blocks of the final length)": paged_concurrency(pool_blocks, lens, bs),
        "contiguous: prompt+max_tokens": contiguous_concurrency(pool_blocks * bs, lens),
        "contiguous: prompt+trace_max_tokens": contiguous_concurrency(
            pool_blocks * bs, [p + longest_out for p in trace["prompt_lens"]]
        ),
        "contiguous: max_model_len": contiguous_concurrency(
            pool_blocks * bs, [trace["max_model_len"]]
        ),
    }


def build(raw: dict[str, Any]) -> Section:
    t = raw["trace"]
    kv = raw["continuous"]["kv"]
    schemes = [("paged (block manager)", kv["paged"])] + [
        (f"contiguous: {name}", s) for name, s in kv["contiguous"].items()
    ]
    util = Table(
        title="KV utilization over the continuous run: live tokens / reserved slots",
        columns=[
            "scheme",
            "step mean (%)",
            "slot-weighted (%)",
            "min (%)",
            "peak reserved (slots)",
            "mean reserved (x paged)",
        ],
        rows=[
            [
                name,
                100 * s["util_step_mean"],
                100 * s["util_slot_weighted"],
                100 * s["util_min"],
                s["peak_reserved_slots"],
                s.get("mean_reserved_vs_paged", 1.0),
            ]
            for name, s in schemes
        ],
        source=mix.SOURCE,
    )
    conc = concurrency_at_fixed_memory(t)
    pool_tokens = (t["num_kv_blocks"] - 1) * t["block_size"]
    conc_table = Table(
        title=f"Requests of this trace that fit at once in the engine's pool of {pool_tokens:,} "
        "KV tokens",
        columns=["scheme", "max concurrent requests"],
        rows=[[name, n] for name, n in conc.items()],
        source=mix.SOURCE,
    )
    names = [name.split(": ")[-1] for name, _ in schemes]
    xs = list(range(len(schemes)))
    fig_util = Figure(
        title="KV utilization (step mean) by allocation scheme",
        x_label="allocation scheme",
        x_unit="name",
        y_label="live tokens / reserved slots",
        y_unit="%",
        kind="bar",
        x_ticks=names,
        series=[Series("step mean", xs, [100 * s["util_step_mean"] for _, s in schemes])],
        source=mix.SOURCE,
    )
    conc_names = list(conc)
    fig_conc = Figure(
        title=f"Max concurrent requests at fixed memory ({pool_tokens:,} KV tokens)",
        log_y=True,
        x_label="allocation scheme",
        x_unit="name",
        y_label="concurrent requests",
        y_unit="requests",
        kind="bar",
        x_ticks=[
            n.split(": ")[-1].replace(" (blocks of the final length)", "") for n in conc_names
        ],
        series=[Series("requests", list(range(len(conc))), [conc[n] for n in conc_names])],
        source=mix.SOURCE,
    )
    paged = kv["paged"]["util_step_mean"]
    worst = kv["contiguous"]["max_model_len"]
    paged_n = conc["paged (blocks of the final length)"]
    max_len_n = conc["contiguous: max_model_len"]
    return Section(
        key=KEY,
        title="Paged KV vs contiguous reservation",
        claim="Allocating KV in blocks on demand wastes only the last partial block per request; "
        "reserving max_model_len per request wastes most of the memory and caps concurrency.",
        status=MEASURED,
        measured=f"the block manager's real allocation at each of {kv['num_steps']} steps of the "
        f"continuous run (block_size {t['block_size']}): live tokens / reserved slots in %; and "
        "from the trace's footprints, requests that fit at once in the engine's real pool",
        baseline="contiguous per-request reservations for the same running set: prompt + "
        f"max_tokens, prompt + the trace's largest max_tokens, and max_model_len "
        f"({t['max_model_len']})",
        reading=f"paged {100 * paged:.1f}% utilized vs {100 * worst['util_step_mean']:.1f}% when "
        f"reserving max_model_len ({worst['mean_reserved_vs_paged']:.0f}x the memory); at fixed "
        f"memory {paged_n} requests fit paged vs {max_len_n} reserving max_model_len.",
        tables=[util, conc_table],
        figures=[fig_util, fig_conc],
        commands=[raw["command"]] if "command" in raw else [],
        notes=[
            "Contiguous prompt + max_tokens assumes the server knows each request's exact "
            "output length in advance; it never does for a request that can stop at EOS, so "
            "max_model_len (or a server-wide cap) is the reservation a contiguous server "
            "has to make."
        ],
    )
