"""Moving one request's KV pages between engines: prefill here, decode there, exactly as if the
request had run in one engine.

Prefill side (the engine that ran the prompt and sampled the first token):

    detach(engine, rid)        -> Detached: the request leaves the engine; its blocks stay held
                                  under a hold id (not free, not evictable) until one of
    release(engine, detached)     the transfer was acknowledged: the blocks go back to the pool
    readopt(engine, detached)     it failed: the request decodes here after all, on those blocks
    read_pages(cache, block_ids)  the pages to send (one gather copy)

Decode side:

    reserve(engine, handoff)   -> Reservation: blocks for the whole prompt, its cached leading
                                  blocks (by block hash) taken from the prefix cache; None when
                                  the pool has no room. Only blocks[num_cached_blocks:] are sent.
    write_pages(cache, block_ids, data)   install received pages
    commit(engine, reservation)   the request joins the running batch as if it had prefilled here
    recompute(engine, reservation)  the pages will not come: prefill locally instead (exact: it is
                                  the path of a preempted sequence that resumes)
    cancel(engine, reservation)   forget it; the blocks go back to the pool

Exactness: after commit the decode engine holds what the prefill engine held after its first
sample: token_ids = prompt + [first], num_computed_tokens = len(prompt), the prompt's K/V in the
same bytes (the cache dtype; an int8 or fp8 row carries its scale, see kv_cache), the generator's
state after one draw, the detokenizer fed the first token and the characters already streamed. Its
next step decodes the first token through the decode kernel, as the prefill engine's would have.

A page is one block of every layer, K and V, in cache order; blocks travel back to back:

    page = storage[:, :, block_id]  ->  [num_layers, 2 (K, V), block_size, num_kv_heads, row]
    pages: [page(b0) | page(b1) | ...]   (row = head_dim elements, or head_dim + 4 bytes: int8, fp8)

Invariant that lets the receiving service write pages while the engine steps in its own thread:
a reserved block is in no block table and no pending copy until commit, so the engine neither
reads nor writes it; write_pages touches only those blocks.

Only single-choice requests (n == 1) are transferred; the caller keeps the others local.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shared.engine.kv_cache import KVCache
from shared.engine.sampler import make_generator
from shared.engine.sequence import Request, Sequence
from shared.wire.sampling_params import SamplingParams

if TYPE_CHECKING:
    from shared.engine.engine import Engine

__all__ = [
    "Detached",
    "Handoff",
    "PageLayout",
    "Reservation",
    "cancel",
    "commit",
    "detach",
    "page_layout",
    "read_pages",
    "readopt",
    "recompute",
    "release",
    "reserve",
    "write_pages",
]


@dataclass(frozen=True)
class PageLayout:
    """What a page is made of; two engines exchange pages only when their layouts are equal."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    row: int  # elements per (token, head): head_dim, or head_dim + 4 bytes for int8 and fp8
    # the cache tensor's dtype: "bfloat16", "float32", "int8", "uint8" (fp8 rows, see kv_cache)...
    dtype: str

    @property
    def page_nbytes(self) -> int:
        return (
            self.num_layers
            * 2
            * self.block_size
            * self.num_kv_heads
            * self.row
            * torch.empty(0, dtype=getattr(torch, self.dtype)).element_size()
        )


def page_layout(cache: KVCache) -> PageLayout:
    num_layers, _, _, block_size, num_kv_heads, row = cache.storage.shape
    return PageLayout(
        num_layers=num_layers,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        row=row,
        dtype=str(cache.storage.dtype).removeprefix("torch."),
    )


@dataclass(frozen=True)
class Handoff:
    """Everything but the pages that the decode side needs to continue the request."""

    request_id: str
    prompt_token_ids: list[int]
    block_hashes: list[int]  # the prompt's full blocks, chained (shared/wire/block_hash.py)
    params: SamplingParams
    priority: int
    first_token_id: int
    num_emitted_chars: int  # of the output text, streamed by the prefill side
    num_cached_tokens: int  # prompt tokens the prefill side served from its prefix cache
    generator_state: bytes | None  # the seeded generator after its first draw (None: unseeded)


@dataclass(frozen=True)
class Detached:
    handoff: Handoff
    hold_id: tuple[str, str]  # the block manager's id for the held blocks
    block_ids: list[int]  # the prompt's blocks, in order (the last one may be partly filled)


def _hold_id(request_id: str) -> tuple[str, str]:
    return ("kv-transfer", request_id)


def detach(engine: Engine, request_id: str) -> Detached:
    """Take a request that has just sampled its first token out of the engine, keeping its blocks.
    Call it between steps, right after the step that sampled that token."""
    request = engine.requests[request_id]
    if request.params.n != 1 or len(request.sequences) != 1:
        raise ValueError(f"request {request_id!r} has {request.params.n} choices; only n=1 moves")
    seq = request.sequences[0]
    num_prompt = seq.num_prompt_tokens
    if seq.num_output_tokens != 1 or seq.num_computed_tokens != num_prompt or request.finished:
        raise ValueError(
            f"request {request_id!r} is not just past its prefill ({seq.num_output_tokens} "
            f"output tokens, {seq.num_computed_tokens}/{num_prompt} prompt tokens computed)"
        )
    bm = engine.block_manager
    hold = _hold_id(request_id)
    bm.fork(seq.seq_id, hold)  # the hold owns a reference to every block ...
    handoff = Handoff(
        request_id=request_id,
        prompt_token_ids=list(request.prompt_token_ids),
        block_hashes=list(seq.full_block_hashes(bm.block_size)[: num_prompt // bm.block_size]),
        params=request.params,
        priority=request.priority,
        first_token_id=seq.token_ids[-1],
        num_emitted_chars=seq.num_emitted_chars,
        num_cached_tokens=request.num_cached_tokens,
        generator_state=(
            bytes(seq.generator.get_state().numpy().tobytes()) if seq.generator else None
        ),
    )
    engine.abort(request_id)  # ... so freeing the sequence's keeps them out of the pool
    return Detached(handoff, hold, bm.block_table(hold))


def release(engine: Engine, detached: Detached) -> None:
    """The pages arrived: give the held blocks back (their hashes stay cached, evictable)."""
    engine.block_manager.free(detached.hold_id)


def readopt(engine: Engine, detached: Detached) -> None:
    """The transfer failed: decode here, on the held blocks, exactly as if never detached (the
    prompt's pages are computed: nothing is prefilled again)."""
    request, seq = _rebuild(engine, detached.handoff)
    engine.block_manager.rename(detached.hold_id, seq.seq_id)
    seq.num_computed_tokens = seq.num_prompt_tokens
    _resume(engine, request, seq)


def read_pages(cache: KVCache, block_ids: list[int]) -> torch.Tensor:
    """The pages of ``block_ids`` as one contiguous uint8 tensor [len(block_ids), page_nbytes]."""
    index = torch.tensor(block_ids, dtype=torch.int64, device=cache.storage.device)
    # One gather: blocks are scattered in the pool, so this copy is the one that cannot be saved.
    pages = cache.storage.permute(2, 0, 1, 3, 4, 5)[index]
    return pages.reshape(len(block_ids), -1).view(torch.uint8).cpu()


def write_pages(cache: KVCache, block_ids: list[int], data: bytes | bytearray | memoryview) -> None:
    """Install pages (as read_pages made them, back to back) into ``block_ids``."""
    storage = cache.storage
    num_layers, two, _, block_size, num_kv_heads, row = storage.shape
    with warnings.catch_warnings():
        # A received message is read-only bytes; it is only read here, so no copy is made of it.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        raw = torch.frombuffer(data, dtype=torch.uint8)
    page_numel = num_layers * two * block_size * num_kv_heads * row
    pages = raw.view(storage.dtype)
    if pages.numel() != page_numel * len(block_ids):
        raise ValueError(
            f"{len(data)} bytes of pages for {len(block_ids)} blocks of "
            f"{page_numel * storage.element_size()} bytes"
        )
    pages = pages.view(len(block_ids), num_layers, two, block_size, num_kv_heads, row)
    index = torch.tensor(block_ids, dtype=torch.int64, device=storage.device)
    storage.permute(2, 0, 1, 3, 4, 5)[index] = pages.to(storage.device)


@dataclass
class Reservation:
    handoff: Handoff
    request: Request
    seq: Sequence
    block_ids: list[int]  # the prompt's blocks
    num_cached_blocks: int  # leading blocks already here (prefix cache): not sent

    @property
    def missing_block_ids(self) -> list[int]:
        return self.block_ids[self.num_cached_blocks :]


def reserve(engine: Engine, handoff: Handoff) -> Reservation | None:
    """Blocks for the prompt; its cached leading blocks are taken from the prefix cache. None: the
    pool has no room now. A prompt the engine would reject raises ValueError."""
    ids = handoff.prompt_token_ids
    engine._validate_prompt(ids, handoff.params)
    if len(handoff.block_hashes) != len(ids) // engine.config.block_size:
        raise ValueError(
            f"{len(handoff.block_hashes)} block hashes for {len(ids)} prompt tokens in blocks of "
            f"{engine.config.block_size}"
        )
    if handoff.request_id in engine.requests:
        raise ValueError(f"request id {handoff.request_id!r} is already in use")
    request, seq = _rebuild(engine, handoff)
    bm = engine.block_manager
    num_cached = bm.match_prefix(ids, handoff.block_hashes)
    got = bm.allocate(seq.seq_id, ids, len(ids) - num_cached, handoff.block_hashes)
    if got is None:
        return None
    return Reservation(
        handoff, request, seq, bm.block_table(seq.seq_id), got // engine.config.block_size
    )


def commit(engine: Engine, reservation: Reservation) -> None:
    """Every missing page is installed: the request decodes from here."""
    seq = reservation.seq
    seq.num_computed_tokens = seq.num_prompt_tokens
    # The prompt's full blocks enter this engine's prefix cache (and its KV events).
    engine.block_manager.commit(
        seq.seq_id, seq.token_ids, seq.num_computed_tokens, engine.scheduler.block_hashes(seq)
    )
    _resume(engine, reservation.request, seq)


def recompute(engine: Engine, reservation: Reservation) -> None:
    """The pages will not come: queue the request to prefill its prompt and first token here.
    Its first token is recomputed through the decode kernel (ScheduledChunk.decode_from), as a
    preempted sequence's sampled tokens are, so the output is the same."""
    engine.block_manager.free(reservation.seq.seq_id)
    request, seq = reservation.request, reservation.seq
    seq.num_computed_tokens = 0
    engine.requests[request.request_id] = request
    request.scheduled_once = True
    engine.scheduler.add(seq)


def cancel(engine: Engine, reservation: Reservation) -> None:
    engine.block_manager.free(reservation.seq.seq_id)


def _rebuild(engine: Engine, handoff: Handoff) -> tuple[Request, Sequence]:
    """The request and its sequence as the prefill engine had them after the first sample."""
    ids = list(handoff.prompt_token_ids)
    params = handoff.params
    request = Request(
        request_id=handoff.request_id,
        prompt_token_ids=ids,
        params=params,
        priority=handoff.priority,
        arrival_order=next(engine._arrivals),
        max_tokens=(
            params.max_tokens if params.max_tokens is not None else engine.max_model_len - len(ids)
        ),
        num_cached_tokens=handoff.num_cached_tokens,
        scheduled_once=True,
    )
    seq = engine._new_sequence(request, 0, list(ids))
    seq.block_hashes = list(handoff.block_hashes)
    if handoff.generator_state is not None:
        seq.generator = make_generator(0, engine.config.device)
        assert seq.generator is not None
        state = torch.frombuffer(bytearray(handoff.generator_state), dtype=torch.uint8)
        seq.generator.set_state(state)
    # Replay the first token through the output processor (stop checks, detokenizer) without
    # emitting it again: the prefill side streamed it and num_emitted_chars of its text.
    engine.outputs.append_token(seq, handoff.first_token_id, None)
    seq.new_token_ids = []
    seq.num_emitted_chars = handoff.num_emitted_chars
    return request, seq


def _resume(engine: Engine, request: Request, seq: Sequence) -> None:
    engine.requests[request.request_id] = request
    engine.scheduler.add_running(seq)
