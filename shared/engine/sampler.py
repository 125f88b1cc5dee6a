"""Batched token sampling over one step's logits (CPU or CUDA).

Order of operations (as vLLM), each stage a no-op for rows that do not use it:

    raw logits ──▶ logprobs (log_softmax of RAW logits, OpenAI semantics)
        │
        ▼
    penalties (repetition: prompt+output tokens; presence/frequency: output counts)
        │
        ├──▶ argmax ──▶ greedy rows
        ▼
    ÷ temperature ─▶ top-k ─▶ top-p ─▶ min-p ─▶ softmax ─▶ argmax(probs / Exp(1)) ─▶ random rows

Invariant: a seeded row's noise comes only from its own generator and every stage is row-wise, so
its token does not depend on the other rows in the batch or on its row index. Unseeded rows share
one batch-wide draw from the default generator.

`SamplingBatch.build` runs once per step; when every row is greedy with no penalties and no
logprobs (the hot path) it allocates no tensors and `sample` is a bare argmax.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from shared.engine.cpu_backend import CpuBackend
from shared.wire.outputs import TokenLogprobs
from shared.wire.sampling_params import SamplingParams

_NEG_INF = float("-inf")
# Without a backend handed in, argmax is torch's: the kernels run only where the caller chose them.
_TORCH = CpuBackend.off("no backend handed to the sampler")


class SamplerOutput(msgspec.Struct, kw_only=True, frozen=True):
    """One entry per row of the batch, in row order; logprobs[i] is None unless row i asked for
    them."""

    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A private RNG for a seeded request; it must live on the device the logits are on."""
    if seed is None:
        return None
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(seed)
    return gen


@dataclass(frozen=True, slots=True)
class PenaltyBatch:
    """Padded token histories; padding id == vocab_size (counted into a dropped extra column).

    Rows that use no penalty carry empty histories, and prompt ids are kept only for rows with a
    repetition penalty, so the cost scales with the rows that need it.
    """

    prompt_token_ids: torch.Tensor  # [num_seqs, max_prompt_len] int64
    output_token_ids: torch.Tensor  # [num_seqs, max_output_len] int64
    repetition_penalties: torch.Tensor  # [num_seqs] fp32, 1.0 = off
    presence_penalties: torch.Tensor  # [num_seqs] fp32, 0.0 = off
    frequency_penalties: torch.Tensor  # [num_seqs] fp32, 0.0 = off


@dataclass(frozen=True, slots=True)
class SamplingBatch:
    """Per-step sampling state. A tensor field is None when no row uses that stage."""

    num_seqs: int
    vocab_size: int
    all_greedy: bool
    greedy_mask: torch.Tensor | None  # [num_seqs] bool; None unless greedy and random rows mix
    temperatures: torch.Tensor | None  # [num_seqs] fp32; 1.0 on greedy rows so division is safe
    top_ks: torch.Tensor | None  # [num_seqs] int64 in [1, vocab_size]; vocab_size = off
    top_ps: torch.Tensor | None  # [num_seqs] fp32 in (0, 1]; 1.0 = off
    min_ps: torch.Tensor | None  # [num_seqs] fp32 in [0, 1]; 0.0 = off
    penalties: PenaltyBatch | None
    seeded_rows: tuple[tuple[int, torch.Generator], ...]  # random rows with their own generator
    has_unseeded_random: bool
    num_logprobs: tuple[int | None, ...]  # per row; None = no logprobs
    max_num_logprobs: int | None  # None when no row wants logprobs

    @classmethod
    def build(
        cls,
        params_list: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingBatch:
        num_seqs = len(params_list)
        if not (len(prompt_token_ids) == len(output_token_ids) == len(generators) == num_seqs):
            raise ValueError(
                "params_list, prompt_token_ids, output_token_ids and generators "
                "must have one entry per sequence"
            )
        greedy = [p.is_greedy for p in params_list]
        all_greedy = all(greedy)
        num_logprobs = tuple(p.logprobs for p in params_list)
        wanted = [n for n in num_logprobs if n is not None]
        penalties = None
        if any(p.uses_penalties for p in params_list):
            penalties = _build_penalties(
                params_list, prompt_token_ids, output_token_ids, vocab_size, device
            )
        common: dict[str, Any] = dict(
            num_seqs=num_seqs,
            vocab_size=vocab_size,
            all_greedy=all_greedy,
            penalties=penalties,
            num_logprobs=num_logprobs,
            max_num_logprobs=max(wanted) if wanted else None,
        )
        if all_greedy:
            return cls(
                greedy_mask=None,
                temperatures=None,
                top_ks=None,
                top_ps=None,
                min_ps=None,
                seeded_rows=(),
                has_unseeded_random=False,
                **common,
            )

        # Greedy rows get neutral values so the vectorised random path runs harmlessly over them.
        temps = [1.0 if g else p.temperature for p, g in zip(params_list, greedy, strict=True)]
        ks = [
            vocab_size if g or p.top_k <= 0 else min(p.top_k, vocab_size)
            for p, g in zip(params_list, greedy, strict=True)
        ]
        ps = [1.0 if g else p.top_p for p, g in zip(params_list, greedy, strict=True)]
        mins = [0.0 if g else p.min_p for p, g in zip(params_list, greedy, strict=True)]
        seeded = tuple(
            (i, gen)
            for i, (gen, g) in enumerate(zip(generators, greedy, strict=True))
            if gen is not None and not g
        )
        f32: dict[str, Any] = dict(dtype=torch.float32, device=device)
        return cls(
            greedy_mask=torch.tensor(greedy, dtype=torch.bool, device=device)
            if any(greedy)
            else None,
            temperatures=torch.tensor(temps, **f32),
            top_ks=torch.tensor(ks, dtype=torch.int64, device=device)
            if any(k < vocab_size for k in ks)
            else None,
            top_ps=torch.tensor(ps, **f32) if any(p < 1.0 for p in ps) else None,
            min_ps=torch.tensor(mins, **f32) if any(m > 0.0 for m in mins) else None,
            seeded_rows=seeded,
            has_unseeded_random=len(seeded) < num_seqs - sum(greedy),
            **common,
        )


def sample(
    logits: torch.Tensor, batch: SamplingBatch, backend: CpuBackend = _TORCH
) -> SamplerOutput:
    """Pick one token per row of `logits` [num_seqs, vocab_size] (fp32, or bf16/fp16 → upcast).
    Argmaxes run on `backend` (its kernel where it applies; the same indices as torch's).

    The input tensor is never modified.
    """
    argmax_rows = backend.argmax_rows
    if logits.dim() != 2 or tuple(logits.shape) != (batch.num_seqs, batch.vocab_size):
        raise ValueError(
            f"logits shape {tuple(logits.shape)} != "
            f"(num_seqs={batch.num_seqs}, vocab_size={batch.vocab_size})"
        )
    if batch.all_greedy and batch.penalties is None and batch.max_num_logprobs is None:
        # Hot path: argmax is exact in bf16 too, so skip the upcast.
        return SamplerOutput(
            sampled_token_ids=argmax_rows(logits).tolist(), logprobs=[None] * batch.num_seqs
        )

    raw = logits.float()
    x = raw
    if batch.penalties is not None:
        pen = batch.penalties
        x = apply_penalties(
            x,
            pen.prompt_token_ids,
            pen.output_token_ids,
            pen.repetition_penalties,
            pen.presence_penalties,
            pen.frequency_penalties,
        )
    if batch.all_greedy:
        token_ids = argmax_rows(x)
    else:
        token_ids = _sample_random(x, batch, argmax_rows)
        if batch.greedy_mask is not None:
            token_ids = torch.where(batch.greedy_mask, argmax_rows(x), token_ids)

    logprobs: list[TokenLogprobs | None] = [None] * batch.num_seqs
    if batch.max_num_logprobs is not None:
        logprobs = compute_logprobs(raw, token_ids, batch.num_logprobs, batch.max_num_logprobs)
    return SamplerOutput(sampled_token_ids=token_ids.tolist(), logprobs=logprobs)


def _sample_random(
    logits: torch.Tensor, batch: SamplingBatch, argmax_rows: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    assert batch.temperatures is not None
    x = logits / batch.temperatures.unsqueeze(1)
    if batch.top_ks is not None or batch.top_ps is not None:
        x = apply_top_k_top_p(x, batch.top_ks, batch.top_ps)
    if batch.min_ps is not None:
        x = apply_min_p(x, batch.min_ps)
    probs = x.softmax(dim=-1)
    # Exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) is a draw from p. A row's draw
    # must consume exactly vocab_size values of its own generator per step, whatever the batch.
    noise = torch.empty_like(probs)
    if batch.has_unseeded_random:
        noise.exponential_()
    for row, gen in batch.seeded_rows:
        noise[row].exponential_(generator=gen)
    # Exp(1) can return exactly 0; 0/0 would be NaN, which argmax treats as the maximum.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return argmax_rows(probs / noise)


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor,
    output_token_ids: torch.Tensor,
    repetition_penalties: torch.Tensor,
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
) -> torch.Tensor:
    """Return penalised logits (a new tensor).

    Token id tensors are [num_seqs, L] int64 padded with vocab_size (= logits.shape[1]).
    Repetition (HF/vLLM): on tokens seen in prompt or output, positive logits are divided by the
    penalty and negative ones multiplied, so a penalty > 1 always makes them less likely.
    Presence/frequency (OpenAI): logit -= frequency * count + presence * (count > 0), over output
    only.
    """
    vocab_size = logits.shape[1]
    output_counts = _token_counts(output_token_ids, vocab_size, logits.dtype)
    output_seen = output_counts > 0
    seen = (_token_counts(prompt_token_ids, vocab_size, logits.dtype) > 0) | output_seen
    rep = repetition_penalties.unsqueeze(1)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    x = torch.where(seen, penalised, logits)
    x = x - frequency_penalties.unsqueeze(1) * output_counts
    return x - presence_penalties.unsqueeze(1) * output_seen.to(logits.dtype)


def apply_top_k_top_p(
    logits: torch.Tensor, top_ks: torch.Tensor | None, top_ps: torch.Tensor | None
) -> torch.Tensor:
    """Mask to -inf everything outside the top-k, then outside the top-p nucleus; at least the most
    likely token always survives. top_ks in [1, vocab] (vocab = off); top_ps in (0, 1] (1 = off).
    Ties with the k-th value are kept (the mask compares values, not positions).
    """
    vocab_size = logits.shape[1]
    sorted_logits, sorted_ids = logits.sort(dim=-1)  # ascending: the best token is last
    if top_ks is not None:
        kth_best = sorted_logits.gather(1, (vocab_size - top_ks).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_best, _NEG_INF)
    if top_ps is not None:
        cum_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum_probs <= 1.0 - top_ps.unsqueeze(1)
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p × (probability of the most likely token)."""
    probs = logits.softmax(dim=-1)
    threshold = min_ps.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, _NEG_INF)


def compute_logprobs(
    raw_logits: torch.Tensor,
    token_ids: torch.Tensor,
    num_logprobs: Sequence[int | None],
    max_num_logprobs: int,
) -> list[TokenLogprobs | None]:
    """OpenAI logprobs from the raw logits: chosen token's logprob and rank, plus the top-N."""
    lp = raw_logits.float().log_softmax(dim=-1)
    chosen = lp.gather(1, token_ids.unsqueeze(1))
    ranks = (lp > chosen).sum(dim=-1).add_(1).tolist()
    chosen_lp = chosen.squeeze(1).tolist()
    ids = token_ids.tolist()
    top_vals: list[list[float]] = [[] for _ in ids]
    top_ids: list[list[int]] = [[] for _ in ids]
    if max_num_logprobs > 0:
        vals, idx = lp.topk(max_num_logprobs, dim=-1)  # sorted descending
        top_vals, top_ids = vals.tolist(), idx.tolist()
    out: list[TokenLogprobs | None] = []
    for i, n in enumerate(num_logprobs):
        if n is None:
            out.append(None)
            continue
        out.append(
            TokenLogprobs(
                token_id=ids[i],
                logprob=chosen_lp[i],
                rank=ranks[i],
                top=list(zip(top_ids[i][:n], top_vals[i][:n], strict=True)),
            )
        )
    return out


def _token_counts(token_ids: torch.Tensor, vocab_size: int, dtype: torch.dtype) -> torch.Tensor:
    """[num_seqs, vocab_size] occurrence counts; the padding id vocab_size lands in a dropped
    column."""
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=dtype, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=dtype))
    return counts[:, :vocab_size]


def pad_token_ids(
    rows: Sequence[Sequence[int]], pad_id: int, device: torch.device | str
) -> torch.Tensor:
    """[len(rows), max_len] int64, right-padded with pad_id."""
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), width), pad_id, dtype=torch.int64)
    for i, r in enumerate(rows):
        if len(r):
            out[i, : len(r)] = torch.as_tensor(r, dtype=torch.int64)
    return out.to(device)


def _build_penalties(
    params_list: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    vocab_size: int,
    device: torch.device | str,
) -> PenaltyBatch:
    prompts = [
        ids if p.uses_repetition_penalty else ()
        for p, ids in zip(params_list, prompt_token_ids, strict=True)
    ]
    outputs = [
        ids if p.uses_penalties else ()
        for p, ids in zip(params_list, output_token_ids, strict=True)
    ]
    f32: dict[str, Any] = dict(dtype=torch.float32, device=device)
    return PenaltyBatch(
        prompt_token_ids=pad_token_ids(prompts, vocab_size, device),
        output_token_ids=pad_token_ids(outputs, vocab_size, device),
        repetition_penalties=torch.tensor([p.repetition_penalty for p in params_list], **f32),
        presence_penalties=torch.tensor([p.presence_penalty for p in params_list], **f32),
        frequency_penalties=torch.tensor([p.frequency_penalty for p in params_list], **f32),
    )
