"""loadtests/ceiling.py: the arithmetic an offline run must do, counted from the model's shapes."""

from __future__ import annotations

import pytest

from loadtests.ceiling import ceiling_seconds, run_flops
from shared.engine.models.config import ModelConfig

TINY = ModelConfig(
    architecture="llama",
    vocab_size=10,
    hidden_size=4,
    intermediate_size=8,
    num_layers=3,
    num_heads=2,
    num_kv_heads=1,
    head_dim=2,
)


def test_run_flops_counts_fed_tokens_sampled_tokens_and_causal_keys():
    # Prompts of 3 and 1 tokens, 2 tokens out: fed 4 and 2 tokens (the last output is never fed).
    flops = run_flops(TINY, [3, 1], 2)
    params_per_layer = 4 * (4 + 2 * 2) + 4 * 4 + 4 * 16 + 8 * 4  # QKV, O, gate-up, down = 144
    assert flops["decoder_linears"] == 2 * params_per_layer * 3 * (4 + 2)
    assert flops["lm_head"] == 2 * 10 * 4 * 2 * 2  # vocab x hidden per sampled token, 4 of them
    # Keys attended: 1+2+3+4 and 1+2; each costs 2 * head_dim for QK^T and as much for PV, per head.
    assert flops["attention"] == 4 * 2 * 2 * 3 * (10 + 3)


def test_ceiling_puts_decoder_linears_at_the_int8_peak_when_given():
    flops = dict(decoder_linears=4e9, lm_head=1e9, attention=1e9)
    assert ceiling_seconds(flops, bf16_gflops=2.0) == pytest.approx(3.0)
    assert ceiling_seconds(flops, bf16_gflops=2.0, int8_gops=4.0) == pytest.approx(2.0)
