"""The report as one HTML file: inline SVG figures, tables, the host, the commands, and a link
from every figure and table to the raw JSON file its numbers were read from (``raw/*.json``,
beside the HTML). Pure but for ``write_report``; figures are drawn by the ``draw`` callable
(``plots.svg`` in the real report, a stub in the tests)."""

from __future__ import annotations

import html
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from loadtests.report.model import ABSENT, FAILED, Figure, Section, Table

INDEX = "index.html"

_CSS = """
body { font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em;
       color: #222; line-height: 1.45; }
h1 { margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: 0.2em; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 0.92em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
th:first-child, td:first-child { text-align: left; }
th { background: #f3f3f3; }
table.kv td { text-align: left; }
.status { display: inline-block; padding: 0.1em 0.5em; border-radius: 0.3em; font-size: 0.85em; }
.measured { background: #dff0d8; } .absent { background: #eee; } .failed { background: #f2dede; }
.reading { font-weight: 600; }
pre { background: #f6f6f6; padding: 0.5em; overflow-x: auto; font-size: 0.88em; }
figure { margin: 1em 0; } figcaption { font-size: 0.9em; color: #555; }
.source { font-size: 0.85em; }
"""


def _e(value: object) -> str:
    return html.escape(str(value))


def format_cell(value: object) -> str:
    """Numbers to a readable precision: integers with thousands separators, floats to 4
    significant digits (from 1000 up, rounded to an integer, so no digits hide in an exponent)."""
    if isinstance(value, bool) or value is None:
        return "—" if value is None else str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value != value:  # NaN
            return "—"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.4g}"
    return str(value)


def _source_link(source: str) -> str:
    return f'<span class="source">data: <a href="{_e(source)}">{_e(source)}</a></span>'


def render_table(table: Table) -> str:
    head = "".join(f"<th>{_e(c)}</th>" for c in table.columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{_e(format_cell(v))}</td>" for v in row) + "</tr>"
        for row in table.rows
    )
    return (
        f"<p><b>{_e(table.title)}</b> {_source_link(table.source)}</p>"
        f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
    )


def render_figure(figure: Figure, draw: Callable[[Figure], str]) -> str:
    return (
        f"<figure>{draw(figure)}<figcaption>{_e(figure.title)}: "
        f"x = {_e(figure.x_label)} ({_e(figure.x_unit)}), "
        f"y = {_e(figure.y_label)} ({_e(figure.y_unit)}). "
        f"{_source_link(figure.source)}</figcaption></figure>"
    )


def render_section(section: Section, draw: Callable[[Figure], str]) -> str:
    css = {ABSENT: "absent", FAILED: "failed"}.get(section.status, "measured")
    parts = [
        f'<section id="{_e(section.key)}"><h2>{_e(section.title)} '
        f'<span class="status {css}">{_e(section.status)}</span></h2>',
        f"<p><i>Claim:</i> {_e(section.claim)}</p>",
    ]
    if section.measured:
        parts.append(f"<p><i>Measured:</i> {_e(section.measured)}</p>")
    if section.baseline:
        parts.append(f"<p><i>Baseline (same run):</i> {_e(section.baseline)}</p>")
    parts.append(f'<p class="reading">Reading: {_e(section.reading)}</p>')
    parts += [render_table(t) for t in section.tables]
    parts += [render_figure(f, draw) for f in section.figures]
    parts += [f"<p>{_e(n)}</p>" for n in section.notes]
    if section.commands:
        parts.append(
            "<p>Reproduce:</p><pre>" + "\n".join(_e(c) for c in section.commands) + "</pre>"
        )
    if section.sources:
        parts.append(
            "<p>Raw data: "
            + ", ".join(f'<a href="{_e(s)}">{_e(s)}</a>' for s in section.sources)
            + "</p>"
        )
    parts.append("</section>")
    return "\n".join(parts)


def render_host(host: Mapping[str, Any], source: str) -> str:
    rows = "".join(
        f"<tr><td>{_e(k)}</td><td>{_e(format_cell(v) if not isinstance(v, list) else v)}</td></tr>"
        for k, v in host.items()
    )
    return (
        '<section id="host"><h2>Host</h2>'
        "<p>Two shared cores: absolute numbers are noisy and depend on what else ran; compare the "
        "configurations measured in the same run (ratios), not across runs. The load average is "
        "the 1/5/15-minute average at the start and at the end of the run.</p>"
        f'<table class="kv"><tbody>{rows}</tbody></table><p>{_source_link(source)}</p></section>'
    )


def render_report(
    *,
    title: str,
    meta: Mapping[str, Any],
    host: Mapping[str, Any],
    sections: Sequence[Section],
    draw: Callable[[Figure], str],
    host_source: str = "raw/host.json",
) -> str:
    """The whole page: header (command, date, duration), contents, host, then one section per
    claim in the given order."""
    toc = "".join(
        f'<li><a href="#{_e(s.key)}">{_e(s.title)}</a> ({_e(s.status)})</li>' for s in sections
    )
    header = "".join(
        f"<tr><td>{_e(k)}</td><td>{_e(format_cell(v))}</td></tr>" for k, v in meta.items()
    )
    body = "\n".join(render_section(s, draw) for s in sections)
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>"
        f'<h1>{_e(title)}</h1><table class="kv"><tbody>{header}</tbody></table>'
        f"<h2>Contents</h2><ol>{toc}<li><a href='#host'>Host</a></li></ol>\n"
        f"{body}\n{render_host(host, host_source)}</body></html>\n"
    )


def write_report(out_dir: str, page: str) -> str:
    """Write ``index.html`` into ``out_dir`` (the raw JSON is already there); returns its path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, INDEX)
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
    return path
