"""Offline batch generation over the engine: ``LLM(...).generate(prompts, params)``.

Prompts are text or lists of token ids (pre-tokenized input). All prompts are submitted at once and
continuous batching interleaves them; results come back in prompt order.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from tqdm import tqdm

from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.wire.outputs import TokenLogprobs
from shared.wire.sampling_params import SamplingParams

Prompt = str | list[int]


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0


class LLM:
    def __init__(
        self, config: EngineConfig | None = None, *, progress: bool = True, **engine_args
    ) -> None:
        self.engine = Engine(config or EngineConfig(**engine_args), progress=progress)
        self._next_id = 0

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        progress: bool = False,
    ) -> list[GenerationResult]:
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # one prompt, text or token ids
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        results: dict[str, GenerationResult] = {}
        order = []
        for prompt, p in zip(prompts, params, strict=True):
            rid = f"llm-{self._next_id}"
            self._next_id += 1
            self.engine.add_request(rid, prompt, p)
            request = self.engine.requests[rid]
            results[rid] = GenerationResult(
                rid, list(request.prompt_token_ids), [CompletionOutput(index=i) for i in range(p.n)]
            )
            order.append(rid)
        bar = tqdm(
            total=len(order), desc="generating", unit="req", disable=not progress, file=sys.stderr
        )
        while self.engine.has_unfinished():
            for out in self.engine.step():
                result = results[out.request_id]
                result.num_cached_tokens = out.num_cached_tokens
                for d in out.deltas:
                    c = result.outputs[d.index]
                    c.text += d.text
                    c.token_ids.extend(d.token_ids)
                    if d.logprobs is not None:
                        c.logprobs = (c.logprobs or []) + list(d.logprobs)
                    c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
                if out.finished:
                    bar.update(1)
        bar.close()
        return [results[rid] for rid in order]
