"""``python -m services.executor``: one engine (role 'both') serving ExecuteRequests over NATS."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import uuid
from dataclasses import dataclass

from services.runtime import env_int, env_str, run_service, setup_logging
from shared.engine.quantization import (KV_CACHE_DTYPE_HELP, KV_CACHE_DTYPES, QUANTIZATION_HELP, QUANTIZATIONS,
                                        kv_dtype_name)

log = logging.getLogger("llmserve.executor")


@dataclass(frozen=True)
class ExecutorProcessConfig:
    nats_url: str
    executor_id: str
    model: str | None
    model_name: str | None
    dtype: str
    quantization: str | None
    kv_cache_dtype: str
    device: str
    memory_budget: str
    num_kv_blocks: int | None
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int | None
    num_threads: int | None
    block_size: int
    seed: int
    heartbeat_interval_s: float
    drain_timeout_s: float
    kv_events: bool = True

    def __post_init__(self) -> None:
        if not self.nats_url:
            raise ValueError("nats_url must not be empty")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.heartbeat_interval_s <= 0:
            raise ValueError(f"heartbeat_interval_s must be > 0, got {self.heartbeat_interval_s}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")


def parse_config(argv: list[str] | None = None) -> ExecutorProcessConfig:
    p = argparse.ArgumentParser(prog="python -m services.executor", description=__doc__)
    p.add_argument("--nats-url", default=env_str("NATS_URL", "nats://127.0.0.1:4222"))
    p.add_argument("--executor-id", default=env_str("LLMSERVE_EXECUTOR_ID", None),
                   help="unique id (default: a random one)")
    p.add_argument("--model", default=env_str("LLMSERVE_MODEL", None),
                   help="GGUF file or Hugging Face directory (default: the bundled SmolLM2)")
    p.add_argument("--model-name", default=env_str("LLMSERVE_MODEL_NAME", None),
                   help="the model name advertised to the gateway (default: the model file's name)")
    p.add_argument("--dtype", default=env_str("LLMSERVE_DTYPE", "bfloat16"))
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=env_str("LLMSERVE_QUANTIZATION", None),
                   help=QUANTIZATION_HELP)
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=env_str("LLMSERVE_KV_CACHE_DTYPE", "auto"),
                   help=KV_CACHE_DTYPE_HELP)
    p.add_argument("--device", default=env_str("LLMSERVE_DEVICE", "cpu"))
    p.add_argument("--memory-budget", default=env_str("LLMSERVE_MEMORY_BUDGET", "2GiB"),
                   help="weights + activations + KV cache, e.g. 2GiB")
    p.add_argument("--num-kv-blocks", type=int, default=env_int("LLMSERVE_NUM_KV_BLOCKS", None),
                   help="KV blocks (overrides --memory-budget)")
    p.add_argument("--max-num-seqs", type=int, default=env_int("LLMSERVE_MAX_NUM_SEQS", 64))
    p.add_argument("--max-num-batched-tokens", type=int, default=env_int("LLMSERVE_MAX_NUM_BATCHED_TOKENS", 512))
    p.add_argument("--max-model-len", type=int, default=env_int("LLMSERVE_MAX_MODEL_LEN", None))
    p.add_argument("--num-threads", type=int, default=env_int("LLMSERVE_NUM_THREADS", None),
                   help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--heartbeat-interval", type=float, default=0.5)
    p.add_argument("--drain-timeout", type=float, default=5.0,
                   help="on SIGTERM, seconds in-flight requests may take to finish")
    p.add_argument("--kv-events", action=argparse.BooleanOptionalAction,
                   default=(env_str("LLMSERVE_KV_EVENTS", None) or "1").lower() not in ("0", "false", "no", "off"),
                   help="publish each step's KV cache events for the prefix index (default on; "
                        "off: they are dropped)")
    a = p.parse_args(argv)
    try:
        return ExecutorProcessConfig(
            nats_url=a.nats_url, executor_id=a.executor_id or f"executor-{uuid.uuid4().hex[:8]}",
            model=a.model, model_name=a.model_name, dtype=a.dtype, quantization=a.quantization,
            kv_cache_dtype=a.kv_cache_dtype, device=a.device,
            memory_budget=a.memory_budget,
            num_kv_blocks=a.num_kv_blocks, max_num_seqs=a.max_num_seqs,
            max_num_batched_tokens=a.max_num_batched_tokens, max_model_len=a.max_model_len,
            num_threads=a.num_threads, block_size=a.block_size, seed=a.seed,
            heartbeat_interval_s=a.heartbeat_interval, drain_timeout_s=a.drain_timeout,
            kv_events=a.kv_events)
    except ValueError as e:
        p.error(str(e))
        raise


def main(argv: list[str] | None = None) -> int:
    config = parse_config(argv)
    if config.num_threads:
        # Before torch is imported: OpenMP reads it once, for every thread it creates.
        os.environ["OMP_NUM_THREADS"] = str(config.num_threads)
    setup_logging("executor")
    from shared.engine.engine import Engine, EngineConfig

    from services.executor.service import ExecutorService, ExecutorServiceConfig
    from services.executor.worker import EngineWorker
    from shared.wire.bus import Bus

    log.info("%s: loading the model...", config.executor_id)
    engine = Engine(EngineConfig(
        model=config.model, dtype=config.dtype, quantization=config.quantization,
        kv_cache_dtype=config.kv_cache_dtype, device=config.device,
        block_size=config.block_size,
        memory_budget=config.memory_budget, num_kv_blocks=config.num_kv_blocks,
        max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
        max_model_len=config.max_model_len, num_threads=config.num_threads, seed=config.seed))
    stats = engine.stats()
    log.info("%s: %s loaded, %d KV blocks of %d tokens (%s), max_model_len %d", config.executor_id,
             engine.model_name, stats.num_total_blocks, config.block_size,
             kv_dtype_name(config.kv_cache_dtype, config.dtype), engine.max_model_len)
    service_config = ExecutorServiceConfig(
        executor_id=config.executor_id, model_name=config.model_name or engine.model_name, max_model_len=engine.max_model_len,
        block_size=config.block_size, max_num_seqs=config.max_num_seqs,
        heartbeat_interval_s=config.heartbeat_interval_s, drain_timeout_s=config.drain_timeout_s)

    async def serve(stop) -> None:
        bus = await Bus.connect(config.nats_url, config.executor_id)
        service = ExecutorService(bus, EngineWorker(engine, num_threads=config.num_threads, kv_events=config.kv_events), service_config)
        await service.start()
        log.info("%s ready (epoch %s)", config.executor_id, service.epoch)
        await stop.wait()
        await service.drain()
        await bus.drain()

    return run_service("executor", serve)


if __name__ == "__main__":
    sys.exit(main())
