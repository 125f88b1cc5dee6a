"""The per-model part of GET /health. Pure module: no I/O.

A stack may serve several models; /health is 200 once any executor is live (a load balancer's
question: can this gateway serve at all?), so it also says, for each model, whether requests for it
can be served now: how many live executors serve it (from the scheduler) and the context length
the tokenizer checks its prompts against (from the tokenizer; null when no tokenizer serves it, so
its requests would end with 404). ``llmserve up`` is ready once every model it serves has both.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from shared.wire.messages import SchedulerStatus, TokenizerStatus


def model_health(
    configured: Sequence[str], scheduler: SchedulerStatus, tokenizer: TokenizerStatus
) -> dict[str, dict[str, Any]]:
    """name → {"num_executors", "max_model_len"} for every model configured at the gateway, served
    by a live executor or known to the tokenizer, in name order."""
    num_executors = Counter(e.model for e in scheduler.executors)
    context = {m.name: m.max_model_len for m in tokenizer.models}
    names = sorted({*configured, *num_executors, *context})
    return {
        name: {"num_executors": num_executors.get(name, 0), "max_model_len": context.get(name)}
        for name in names
    }
