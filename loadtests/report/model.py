"""What one section of the report holds (pure: no I/O, no plotting).

A section states its claim, what was measured, the baseline it was measured against in the same
run, and a one-line reading. Every table and figure names the raw JSON file (under ``raw/``) its
numbers were read from; a section whose feature does not exist has status ``ABSENT`` and holds no
numbers at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

MEASURED = "measured"
ABSENT = "not implemented"
FAILED = "failed"
STATUSES = (MEASURED, ABSENT, FAILED)


@dataclass(frozen=True)
class Series:
    name: str
    xs: Sequence[float]
    ys: Sequence[float]

    def __post_init__(self) -> None:
        if len(self.xs) != len(self.ys):
            raise ValueError(f"series {self.name!r}: {len(self.xs)} xs but {len(self.ys)} ys")


@dataclass(frozen=True)
class Figure:
    """A plot of one or more series. Both axes carry a unit: a figure without one is an error,
    not a style choice. ``hlines``: named horizontal reference lines (e.g. a ceiling)."""

    title: str
    x_label: str
    x_unit: str
    y_label: str
    y_unit: str
    series: Sequence[Series]
    source: str  # the raw JSON file (relative to the report) the numbers come from
    kind: str = "line"  # "line" or "bar" (bar: xs are category indices, x_ticks their names)
    x_ticks: Sequence[str] = ()
    hlines: Sequence[tuple[str, float]] = ()
    log_x: bool = False
    log_y: bool = False

    def __post_init__(self) -> None:
        if not self.x_unit.strip() or not self.y_unit.strip():
            raise ValueError(f"figure {self.title!r}: every axis needs a unit")
        if self.kind not in ("line", "bar"):
            raise ValueError(f"figure {self.title!r}: kind must be line or bar, got {self.kind!r}")
        if not self.source:
            raise ValueError(f"figure {self.title!r}: no raw JSON source")


@dataclass(frozen=True)
class Table:
    title: str
    columns: Sequence[str]  # header cells, units included, e.g. "TTFT p50 (ms)"
    rows: Sequence[Sequence[object]]
    source: str

    def __post_init__(self) -> None:
        for row in self.rows:
            if len(row) != len(self.columns):
                raise ValueError(
                    f"table {self.title!r}: a row has {len(row)} cells for {len(self.columns)} "
                    "columns"
                )
        if not self.source:
            raise ValueError(f"table {self.title!r}: no raw JSON source")


@dataclass(frozen=True)
class Section:
    key: str  # anchor and raw JSON stem
    title: str
    claim: str
    status: str
    measured: str = ""  # what was measured, units included
    baseline: str = ""  # what it was measured against, in the same run
    reading: str = ""  # one line: what the numbers say
    tables: Sequence[Table] = ()
    figures: Sequence[Figure] = ()
    commands: Sequence[str] = ()  # how to reproduce the numbers outside the report
    notes: Sequence[str] = ()
    raw_files: Sequence[str] = field(default=())

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"section {self.key!r}: unknown status {self.status!r}")
        if self.status == ABSENT and (self.tables or self.figures):
            raise ValueError(f"section {self.key!r}: a feature that does not exist has no numbers")
        if self.status == MEASURED and not (self.measured and self.baseline and self.reading):
            raise ValueError(
                f"section {self.key!r}: say what was measured, against what, and what it reads"
            )

    @property
    def sources(self) -> list[str]:
        """Every raw JSON file this section's numbers come from, each once, in order."""
        names = [
            *self.raw_files,
            *(t.source for t in self.tables),
            *(f.source for f in self.figures),
        ]
        return list(dict.fromkeys(names))


def absent(key: str, title: str, claim: str, why: str, *notes: str) -> Section:
    """A section for a feature this tree does not have: it says so and shows no result."""
    return Section(key=key, title=title, claim=claim, status=ABSENT, reading=why, notes=notes)


def failed(key: str, title: str, claim: str, error: str) -> Section:
    """A section whose measurement raised: the error is the reading, no numbers are shown."""
    return Section(key=key, title=title, claim=claim, status=FAILED, reading=error)
