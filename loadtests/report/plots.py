"""A ``Figure`` drawn as inline SVG with matplotlib (the Agg backend: no display needed)."""

from __future__ import annotations

import io

from loadtests.report.model import Figure


def svg(figure: Figure) -> str:
    """The figure as an ``<svg>`` element (the XML prolog and doctype dropped, so it inlines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 3.6), dpi=100)
    try:
        if figure.kind == "bar":
            n = max(len(figure.series), 1)
            width = 0.8 / n
            for i, s in enumerate(figure.series):
                xs = [x + (i - (n - 1) / 2) * width for x in s.xs]
                ax.bar(xs, s.ys, width=width, label=s.name)
            if figure.x_ticks:
                ax.set_xticks(range(len(figure.x_ticks)), figure.x_ticks, fontsize=8)
        else:
            for s in figure.series:
                ax.plot(s.xs, s.ys, marker="o", label=s.name)
            if figure.log_x:
                ax.set_xscale("log", base=2)
            if figure.x_ticks:
                ax.set_xticks(list(figure.series[0].xs), figure.x_ticks)
        if figure.log_y:
            ax.set_yscale("log")
        for name, y in figure.hlines:
            ax.axhline(y, linestyle="--", color="grey", linewidth=1)
            ax.annotate(
                name,
                (0.01, y),
                xycoords=("axes fraction", "data"),
                fontsize=8,
                va="bottom",
                color="grey",
            )
        ax.set_title(figure.title, fontsize=10)
        ax.set_xlabel(f"{figure.x_label} ({figure.x_unit})")
        ax.set_ylabel(f"{figure.y_label} ({figure.y_unit})")
        ax.grid(True, alpha=0.3)
        if len(figure.series) > 1 or figure.hlines:
            ax.legend(fontsize=8)
        fig.tight_layout()
        buf = io.StringIO()
        fig.savefig(buf, format="svg")
    finally:
        plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg") :]
