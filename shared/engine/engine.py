"""The engine: add requests, step, get per-request deltas. One engine = one executor's model + KV
pool.

Per step: the scheduler picks tokens under the batch budget, pending copy-on-write block copies are
applied, one forward runs over the flattened batch, computed blocks are committed to the prefix
cache, the sampler draws one token per sequence that reached its end, and the output processor
turns those into deltas. Not thread-safe: one thread owns an Engine.

A long prefill's chunk (``scheduler.LongPrefill``) runs in a forward of its own, advanced for
``prefill_slice_ms`` at a time (whole layers) in steps of its own: while anything else has tokens to
run, steps alternate between that batch and a slice, so a request that arrives mid-prefill waits
for at most one slice (plus a layer) before its own step. Only after its last layer is the chunk
counted computed, committed and (at the prompt's end) sampled, exactly as a batch's chunk is; the
forward is dropped if its sequence is preempted or aborted meanwhile.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass

import torch

from shared.engine.block_manager import BlockManager
from shared.engine.config import EngineConfig
from shared.engine.cpu_backend import CpuBackend
from shared.engine.kv_cache import KVCache
from shared.engine.memory import parse_bytes, plan_memory
from shared.engine.model_runner import Forward, ModelRunner, ScheduledChunk
from shared.engine.models.gguf_linear import quantize_model_int4
from shared.engine.models.int8_linear import calibration_text, int8_supported, quantize_model_int8
from shared.engine.models.loader import resolve_dtype, resolve_model_path
from shared.engine.models.runtime import ModelRuntime, load_runtime
from shared.engine.output_processor import OutputProcessor
from shared.engine.quantization import kv_dtype_name
from shared.engine.sampler import SamplingBatch, make_generator, sample
from shared.engine.scheduler import LongPrefill, Scheduler
from shared.engine.sequence import Request, Sequence, SequenceStatus
from shared.engine.speculative import make_speculator
from shared.engine.step_record import PrefillChunk, StepRecord
from shared.engine.tokenizer import Tokenizer
from shared.wire.kv_events import KVEventBatch
from shared.wire.outputs import EngineStats, RequestOutput
from shared.wire.sampling_params import SamplingParams


class PromptTooLongError(ValueError):
    """The prompt (plus the requested output) does not fit the context or the KV pool."""


@dataclass
class _LayeredPrefill:
    """A long prefill's chunk in flight: its sequence, tokens, chunk and forward."""

    seq: Sequence
    num_new: int
    chunk: ScheduledChunk
    forward: Forward
    start_ns: int  # its first layer began (time.time_ns(), for its trace span)


def _is_prefill(seq: Sequence, num_new: int) -> bool:
    """A chunk of the prompt, or a preempted sequence's recompute (several tokens at once, not
    counting speculative proposals)."""
    return num_new - len(seq.draft_token_ids) > 1 or seq.num_computed_tokens < seq.num_prompt_tokens


def _prefill_chunk(seq: Sequence, num_new: int) -> PrefillChunk:
    """The step record's view of a prefill chunk; taken before its tokens count computed."""
    return PrefillChunk(
        seq.request.request_id, seq.num_computed_tokens, num_new, seq.request.num_cached_tokens
    )


class Engine:
    """``backend``: the CPU kernels to run on (default: ``CpuBackend.pick``, the best this host has
    for the configured device and dtype); the model, attention and the sampler all run on this
    one."""

    def __init__(
        self, config: EngineConfig, *, progress: bool = True, backend: CpuBackend | None = None
    ) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        path = resolve_model_path(config.model)
        self.model_name = os.path.basename(os.path.normpath(path))
        self.tokenizer = Tokenizer.from_path(path)
        self.backend = backend or CpuBackend.pick(config.device, resolve_dtype(config.dtype))
        if config.quantization is not None and not int8_supported(self.backend.ops):
            raise ValueError(
                f"quantization={config.quantization!r} needs the CPU kernels (kernels/cpu), which "
                f"are unavailable here: {self.backend.reason}"
            )
        self.model = load_runtime(
            path,
            dtype=config.dtype,
            device=config.device,
            backend=self.backend,
            progress=progress,
            quantization="gguf" if config.quantization == "gguf" else None,
        )
        if config.quantization == "int8":
            quantize_model_int8(self.model, self.tokenizer.encode(calibration_text()), self.backend)
        elif config.quantization == "int4":
            quantize_model_int4(self.model)
        self.draft_model = self._load_draft(path) if config.speculative == "draft" else None
        self.model_config = self.model.config
        self.max_model_len = min(
            config.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
        )
        num_blocks = config.num_kv_blocks
        if num_blocks is None:
            # config.dtype is a name the loader accepted; the ledger uses the same names.
            ledger = plan_memory(
                self.model_config,
                memory_budget_bytes=parse_bytes(config.memory_budget),
                weight_dtype=config.dtype,
                kv_dtype=kv_dtype_name(config.kv_cache_dtype, config.dtype),
                block_size=config.block_size,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs,
                context_len=self.max_model_len,
                resident_weight_bytes=self.resident_weight_bytes(),
                quantization=config.quantization,
            )
            num_blocks = ledger.num_kv_blocks
        self.kv_cache = KVCache(
            self.model_config,
            num_blocks,
            config.block_size,
            self.model.dtype,
            config.device,
            config.kv_cache_dtype,
        )
        self.runner = ModelRunner(self.model, self.kv_cache)
        self.block_manager = BlockManager(
            num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            long_prefill=LongPrefill(
                config.long_prefill_token_threshold, config.long_prefill_chunk_tokens
            ),
        )
        self.speculator = make_speculator(
            config,
            None if self.draft_model is None else ModelRunner(self.draft_model, self.kv_cache),
            self.scheduler,
            self.block_manager,
            self.backend.argmax_rows,
            self.max_model_len,
        )
        self._layered: _LayeredPrefill | None = None
        self._slice_due = False  # a batch ran while a long prefill is in flight: slice next
        self.outputs = OutputProcessor(self.tokenizer, self.max_model_len)
        self.requests: dict[str, Request] = {}
        self._kv_events: KVEventBatch | None = None
        # Tracing's view of each step (step_record.py); off unless the executor turns it on.
        self.record_steps = False
        self._step_record: StepRecord | None = None
        self._arrivals = itertools.count()
        self._counters = dict(
            num_prompt_tokens=0,
            num_computed_tokens=0,
            num_generated_tokens=0,
            num_steps=0,
            last_step_num_tokens=0,
            last_step_num_seqs=0,
        )
        self._step_seconds_total = 0.0
        # Requests whose first step ran since the last take_first_scheduled (queue-time metric).
        self._first_scheduled: list[str] = []

    def _load_draft(self, path: str) -> ModelRuntime:
        """The model's int8-weight twin, the draft of speculative decoding (speculative/draft.py):
        the model itself when its linears are int8 already."""
        if not int8_supported(self.backend.ops):
            raise ValueError(
                "speculative='draft' drafts with the model's int8 twin, which needs the CPU "
                f"kernels (kernels/cpu), unavailable here: {self.backend.reason}; use "
                "speculative='ngram'"
            )
        if self.config.quantization == "int8":
            return self.model
        draft = load_runtime(
            path,
            dtype=self.config.dtype,
            device=self.config.device,
            backend=self.backend,
            progress=False,
        )
        quantize_model_int8(draft, self.tokenizer.encode(calibration_text()), self.backend)
        return draft

    # ---- requests -------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        block_hashes: list[int] | None = None,
    ) -> None:
        """Queue a request. block_hashes: the chained hashes of the prompt's full blocks
        (hash_prompt_blocks with this engine's block_size), as the tokenizer computed them; None:
        the sequence hashes its blocks when the prefix cache first needs them. Either way each block
        of a request is hashed once."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._validate_prompt(ids, params)
        block_size = self.config.block_size
        if block_hashes is not None and len(block_hashes) != len(ids) // block_size:
            raise ValueError(
                f"block_hashes has {len(block_hashes)} hashes, but the prompt's {len(ids)} "
                f"tokens fill {len(ids) // block_size} blocks of {block_size}: were they hashed "
                "with another block size?"
            )
        max_tokens = (
            params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
        )
        request = Request(
            request_id=request_id,
            prompt_token_ids=ids,
            params=params,
            priority=priority,
            arrival_order=next(self._arrivals),
            max_tokens=max_tokens,
        )
        seq = self._new_sequence(request, 0, list(ids))
        if block_hashes is not None:
            seq.block_hashes = list(block_hashes)
        self.requests[request_id] = request
        self.scheduler.add(seq)
        self._counters["num_prompt_tokens"] += len(ids)

    def _validate_prompt(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        total = len(ids) + (params.max_tokens or 0)
        if len(ids) >= self.max_model_len or total > self.max_model_len:
            raise PromptTooLongError(
                f"this model's maximum context length is {self.max_model_len} tokens; "
                f"the prompt has {len(ids)} tokens and max_tokens asks for "
                f"{params.max_tokens or 0} more"
            )
        usable_tokens = (self.kv_cache.num_blocks - 1) * self.config.block_size
        if total > usable_tokens:
            raise PromptTooLongError(
                f"the request needs {total} tokens of KV cache but the pool holds {usable_tokens}"
            )

    def _new_sequence(self, request: Request, index: int, token_ids: list[int]) -> Sequence:
        seed = request.params.seed
        seq = Sequence(
            request=request,
            index=index,
            token_ids=token_ids,
            generator=make_generator(None if seed is None else seed + index, self.config.device),
        )
        request.sequences.append(seq)
        self.outputs.start(seq)
        return seq

    def abort(self, request_id: str) -> bool:
        """Forget a request and free its KV blocks at once. False if it is unknown or finished."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        for seq in request.sequences:
            self.scheduler.remove(seq)
        self._layered_in_flight()  # drops the forward of an aborted long prefill
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        start_s = time.perf_counter()
        try:
            return self._step()
        finally:
            self._step_seconds_total += time.perf_counter() - start_s
            # The block manager's events are drained every step and the engine keeps only the last
            # step's batch, so memory stays bounded whether or not anyone takes them. A batch not
            # taken before the next step is dropped; its seq is then missing, which tells a consumer
            # to resync.
            self._kv_events = self.block_manager.take_events()

    def take_kv_events(self) -> KVEventBatch | None:
        """The KV events of the last step (None: it changed no cached block, or they were taken)."""
        batch, self._kv_events = self._kv_events, None
        return batch

    def take_first_scheduled(self) -> list[str]:
        """Ids of the requests scheduled for the first time since the last call (a request
        preempted and scheduled again is not named twice)."""
        ids, self._first_scheduled = self._first_scheduled, []
        return ids

    def take_step_record(self) -> StepRecord | None:
        """What the last step did (None: recording is off, the step ran nothing, or it was
        taken)."""
        record, self._step_record = self._step_record, None
        return record

    def kv_cache_snapshot(self) -> tuple[int, list[int]]:
        """(seq, cached block hashes): the cache as the KV event batches up to ``seq`` describe it.
        Call it between steps (the executor's engine thread does)."""
        return self.block_manager.snapshot()

    def _step(self) -> list[RequestOutput]:
        start_ns = time.time_ns() if self.record_steps else 0
        self._counters["num_steps"] += 1
        self._counters["last_step_num_tokens"] = 0
        self._counters["last_step_num_seqs"] = 0
        if self._layered_in_flight() and self._slice_due:
            return self._advance_layered()
        if self.speculator is not None:
            self.speculator.plan()
        try:
            return self._run_schedule(start_ns)
        finally:
            if self.speculator is not None:
                self.speculator.end_step()

    def _run_schedule(self, start_ns: int) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        # Copy-on-write copies of this schedule's allocations, before any forward writes.
        self.kv_cache.copy_blocks(self.block_manager.take_pending_copies())
        self._layered_in_flight()  # drops a forward whose sequence this schedule preempted
        if sched.layered is not None:
            seq, num_new = sched.layered
            self._note_scheduled(seq)
            chunk = self._chunk(seq, num_new)
            self._layered = _LayeredPrefill(
                seq, num_new, chunk, self.runner.start([chunk]), time.time_ns()
            )
        if sched.scheduled:
            if self.speculator is not None:  # after the copies: a draft forward reads the cache
                sched.scheduled = self.speculator.propose(sched.scheduled)
            for seq, _ in sched.scheduled:
                self._note_scheduled(seq)
            self._slice_due = self._layered_in_flight()
            self._counters["last_step_num_tokens"] = sched.num_tokens
            self._counters["last_step_num_seqs"] = len(sched.scheduled)
            # Taken before the batch runs: a chunk starts where its sequence's computed tokens end.
            prefills = (
                [_prefill_chunk(seq, n) for seq, n in sched.scheduled if _is_prefill(seq, n)]
                if self.record_steps
                else []
            )
            outputs = self._run_batch(sched.scheduled)
            if self.record_steps:
                self._step_record = StepRecord(
                    start_ns=start_ns,
                    end_ns=time.time_ns(),
                    prefill_chunks=tuple(prefills),
                    preempted_request_ids=tuple(s.request.request_id for s in sched.preempted),
                )
            return outputs
        if self._layered_in_flight():
            return self._advance_layered()
        return []

    def _note_scheduled(self, seq: Sequence) -> None:
        if not seq.request.scheduled_once:
            seq.request.scheduled_once = True
            self._first_scheduled.append(seq.request.request_id)

    def _layered_in_flight(self) -> bool:
        """Whether a long prefill's forward is in flight, dropping one whose sequence the scheduler
        no longer runs layered (preempted or aborted: its chunk is recomputed or forgotten)."""
        s = self.scheduler
        if self._layered is not None and (self._layered.seq is not s.layered or not s.in_flight):
            self._layered = None
        return self._layered is not None

    def _advance_layered(self) -> list[RequestOutput]:
        """One slice of the long prefill in flight; once its last layer has run, the chunk is done
        like a batch's."""
        layered = self._layered
        assert layered is not None
        self._slice_due = False
        until = time.perf_counter() + self.config.prefill_slice_ms / 1000
        if not layered.forward.advance(until):
            return []
        self._layered = None
        prefill = _prefill_chunk(layered.seq, layered.num_new)
        self.scheduler.end_layered(layered.seq, layered.num_new)
        self._counters["last_step_num_tokens"] = layered.num_new
        self._counters["last_step_num_seqs"] = 1
        outputs = self._finish([(layered.seq, layered.num_new)], [layered.chunk], layered.forward)
        if self.record_steps:  # the chunk's span: from its first layer to its sampled token
            self._step_record = StepRecord(
                start_ns=layered.start_ns,
                end_ns=time.time_ns(),
                prefill_chunks=(prefill,),
                preempted_request_ids=(),
            )
        return outputs

    def _chunk(self, seq: Sequence, num_new: int) -> ScheduledChunk:
        """``num_new`` tokens of ``seq`` from its first uncomputed one: its own tokens, then its
        speculative proposals (each of those, and the token before them, gets a logits row)."""
        start = seq.num_computed_tokens
        drafts = seq.draft_token_ids
        num_own = num_new - len(drafts)
        return ScheduledChunk(
            token_ids=seq.token_ids[start : start + num_own] + drafts,
            num_computed=start,
            block_table=self.block_manager.block_table(seq.seq_id),
            need_logits=start + num_own == len(seq.token_ids),
            decode_from=seq.num_prompt_tokens,
            num_logits=1 + len(drafts),
        )

    def _run_batch(self, scheduled: list[tuple[Sequence, int]]) -> list[RequestOutput]:
        chunks = [self._chunk(seq, num_new) for seq, num_new in scheduled]
        forward = self.runner.start(chunks)
        forward.advance()
        for seq, num_new in scheduled:
            # Proposals count computed only once verified (Speculator.verify).
            seq.num_computed_tokens += num_new - len(seq.draft_token_ids)
        return self._finish(scheduled, chunks, forward)

    def _finish(
        self, scheduled: list[tuple[Sequence, int]], chunks: list[ScheduledChunk], forward: Forward
    ) -> list[RequestOutput]:
        """After ``forward`` over ``chunks`` (their tokens counted computed): commit the computed
        blocks, sample the sequences whose chunk reached their end, and collect the deltas."""
        logits = forward.logits()
        self._counters["num_computed_tokens"] += sum(n for _, n in scheduled)
        for seq, _ in scheduled:
            self.block_manager.commit(
                seq.seq_id, seq.token_ids, seq.num_computed_tokens, self.scheduler.block_hashes(seq)
            )
        # Rows of `logits` follow the chunks that need them, in order: one each, and one more per
        # speculative proposal.
        to_sample: list[Sequence] = []
        rows: list[int] = []
        drafted: list[tuple[Sequence, int]] = []  # (sequence with proposals, its first row)
        row = 0
        for (seq, _), chunk in zip(scheduled, chunks, strict=True):
            if not chunk.need_logits:
                continue
            to_sample.append(seq)
            rows.append(row)
            if seq.index == 0 and seq.request.params.n > 1 and len(seq.request.sequences) == 1:
                # The prompt is done: fork the other choices, sharing its blocks (copy-on-write for
                # the partly filled last one), and sample each of them from the same logits row.
                for index in range(1, seq.request.params.n):
                    child = self._new_sequence(seq.request, index, list(seq.token_ids))
                    child.block_hashes = list(seq.block_hashes)
                    child.num_computed_tokens = seq.num_computed_tokens
                    self.block_manager.fork(seq.seq_id, child.seq_id)
                    self.scheduler.add_running(child)
                    to_sample.append(child)
                    rows.append(row)
            if seq.draft_token_ids:
                drafted.append((seq, row))
            row += chunk.num_logits
        self._sample(logits, to_sample, rows)
        if drafted:
            assert self.speculator is not None
            self.speculator.verify(
                logits, drafted, lambda seqs, rows: self._sample(logits, seqs, rows)
            )
        return self._collect_outputs(to_sample)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
        if len(rows) != logits.shape[0] or rows != list(range(len(rows))):
            logits = logits[torch.tensor(rows)]
        batch = SamplingBatch.build(
            [s.request.params for s in seqs],
            [s.request.prompt_token_ids for s in seqs],
            [s.output_token_ids for s in seqs],
            [s.generator for s in seqs],
            self.model_config.vocab_size,
            logits.device,
        )
        result = sample(logits, batch, self.backend)
        for seq, token, lp in zip(seqs, result.sampled_token_ids, result.logprobs, strict=True):
            self.outputs.append_token(seq, token, lp)
        self._counters["num_generated_tokens"] += len(seqs)

    def _collect_outputs(self, sampled: list[Sequence]) -> list[RequestOutput]:
        touched: dict[str, Request] = {}
        for seq in sampled:
            touched.setdefault(seq.request.request_id, seq.request)
            if seq.finish_reason is not None and seq.status is not SequenceStatus.FINISHED:
                seq.status = SequenceStatus.FINISHED
                self.scheduler.remove(seq)
        outputs = []
        for request in touched.values():
            deltas = [d for s in request.sequences if (d := self.outputs.take_delta(s)) is not None]
            if not deltas:
                continue
            finished = request.finished
            outputs.append(
                RequestOutput(
                    request_id=request.request_id,
                    deltas=deltas,
                    num_prompt_tokens=len(request.prompt_token_ids),
                    num_cached_tokens=request.num_cached_tokens,
                    finished=finished,
                )
            )
            if finished:
                del self.requests[request.request_id]
        return outputs

    # ---- counters -------------------------------------------------------------------------------

    def resident_weight_bytes(self) -> int:
        """The model's weights, and its speculative draft's when that is a model of its own."""
        draft = self.draft_model
        extra = draft.weight_bytes() if draft is not None and draft is not self.model else 0
        return self.model.weight_bytes() + extra

    def kv_cache_bytes(self) -> int:
        return self.kv_cache.num_bytes

    def num_kv_blocks(self) -> int:
        """The pool's blocks, padding block 0 included."""
        return self.kv_cache.num_blocks

    def stats(self) -> EngineStats:
        bm, spec = self.block_manager, self.speculator
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_total_blocks=bm.num_blocks - 1,
            num_free_blocks=bm.num_free_blocks,
            kv_cache_usage=bm.usage,
            prefix_cache_queries_tokens=bm.prefix_cache_queries_tokens,
            prefix_cache_hits_tokens=bm.prefix_cache_hits_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_cached_blocks=bm.num_cached_blocks,
            step_seconds_total=self._step_seconds_total,
            spec_num_drafts=spec.num_drafts if spec else 0,
            spec_num_draft_tokens=spec.num_draft_tokens if spec else 0,
            spec_num_accepted_tokens=spec.num_accepted_tokens if spec else 0,
            **self._counters,
        )
