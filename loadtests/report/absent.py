"""Sections for claims this tree cannot measure yet: each says what is missing and shows no
number (a fake or borrowed result would be worse than none)."""

from __future__ import annotations

from loadtests.report.model import Section, absent


def speculative_decoding() -> Section:
    return absent(
        "speculative_decoding",
        "Speculative decoding",
        "A small draft model (or n-gram lookup) proposes several tokens that the target model "
        "verifies in one forward pass, cutting decode latency when the proposals are accepted.",
        "Not implemented: the engine has no draft model, no n-gram proposer and no verification "
        "step, so there is no speedup to measure.",
        "When it lands, this section should compare decode ms/token and acceptance rate against "
        "the same engine without speculation, in the same run.",
    )


def all_absent() -> list[Section]:
    return [speculative_decoding()]
