"""Paged-attention metadata for one flattened forward pass.

A step's batch is one token axis holding every scheduled sequence's new tokens back to back,
decodes first, then prefill chunks:

    tokens:  [d0][d1][d2][p0 p0 p0 p0][p1 p1 p1]
             └ num_decodes ┘└─────── prefill chunks ──────┘
    query_start_loc = [0, 1, 2, 3, 7, 10]

A sequence's K/V live in fixed-size blocks of the KV cache named by its row of ``block_tables``;
token ``t`` of a sequence is stored at slot
``block_tables[s][t // block_size] * block_size + t % block_size``. ``slot_mapping`` holds that slot
for every new token, so the layer writes K/V before attending.

"Sequences" here are attention items: a preempted sequence recomputing its sampled tokens appears as
one decode item per token, each with the same block table and its own length (see
``ScheduledChunk.decode_from``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [num_tokens] int64, absolute position of each new token
    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot each new token's K/V is written to
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int64, padded with block 0
    seq_lens: list[int]  # per sequence: tokens in the cache after this step (context + new)
    query_lens: list[int]  # per sequence: new tokens in this step
    query_start_loc: list[int]  # [num_seqs + 1] prefix sums of query_lens
    num_decodes: int  # the first num_decodes sequences have query_len == 1
    block_size: int
    decode_seq_lens: torch.Tensor  # [num_decodes] int64, seq_lens of the decodes as a tensor
    prefill_seq_lens: torch.Tensor  # [num_seqs - num_decodes] int64, seq_lens of the prefill chunks
    prefill_query_start: torch.Tensor  # [num_seqs - num_decodes + 1] int64, query_start_loc of the
    # prefill chunks, shifted to start at 0
    mask_dtype: torch.dtype = torch.float32
    # Built on first use by a backend that needs it, then shared by every layer of the step.
    _decode_mask: torch.Tensor | None = field(default=None, repr=False)

    @property
    def decode_mask(self) -> torch.Tensor:
        """[num_decodes, 1, 1, max_len] additive mask in ``mask_dtype`` over decode keys gathered
        padded to whole blocks: every key at or past a sequence's length is -inf."""
        if self._decode_mask is None:
            lens = self.decode_seq_lens
            max_len = (
                -(-max(self.seq_lens[: self.num_decodes]) // self.block_size) * self.block_size
            )
            arange = torch.arange(max_len, device=lens.device)
            mask = torch.zeros(
                self.num_decodes, 1, 1, max_len, dtype=self.mask_dtype, device=lens.device
            )
            mask.masked_fill_((arange[None, :] >= lens[:, None])[:, None, None, :], float("-inf"))
            self._decode_mask = mask
        return self._decode_mask

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]


def build_attention_metadata(
    *,
    query_lens: list[int],
    num_computed: list[int],
    block_tables: list[list[int]],
    block_size: int,
    num_decodes: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> AttentionMetadata:
    """Build metadata for sequences ordered decodes first. ``num_computed[i]`` tokens of sequence i
    are already in the cache; its ``query_lens[i]`` new tokens follow them. The first
    ``num_decodes`` sequences have one new token each and take the decode path; the rest are prefill
    chunks (one token too, possibly: see ``ScheduledChunk.decode_from``)."""
    if not (len(query_lens) == len(num_computed) == len(block_tables)):
        raise ValueError(
            "query_lens, num_computed and block_tables must have one entry per sequence"
        )
    if not 0 <= num_decodes <= len(query_lens) or any(n != 1 for n in query_lens[:num_decodes]):
        raise ValueError(
            f"num_decodes={num_decodes}: the first num_decodes sequences must have one new "
            "token each"
        )
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    starts = [0]
    for q_len, start, table in zip(query_lens, num_computed, block_tables, strict=True):
        end = start + q_len
        if (end + block_size - 1) // block_size > len(table):
            raise ValueError(f"block table of {len(table)} blocks cannot hold {end} tokens")
        positions.extend(range(start, end))
        slots.extend(
            table[p // block_size] * block_size + p % block_size for p in range(start, end)
        )
        seq_lens.append(end)
        starts.append(starts[-1] + q_len)
    max_blocks = max((len(t) for t in block_tables), default=0)
    padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
    lens = torch.tensor(
        seq_lens, dtype=torch.int64, device=device
    )  # sliced below: both halves contiguous
    return AttentionMetadata(
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int64, device=device).reshape(
            len(padded), max_blocks
        ),
        seq_lens=seq_lens,
        query_lens=list(query_lens),
        query_start_loc=starts,
        num_decodes=num_decodes,
        block_size=block_size,
        decode_seq_lens=lens[:num_decodes],
        prefill_seq_lens=lens[num_decodes:],
        prefill_query_start=torch.tensor(
            [s - starts[num_decodes] for s in starts[num_decodes:]],
            dtype=torch.int64,
            device=device,
        ),
        mask_dtype=dtype,
    )
