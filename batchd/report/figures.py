"""The report's plots, as plotly figures, each with the few numbers a reader looks for first.

Everything is binned here (numpy), not in the browser: a figure carries at most a few hundred
numbers whatever the batch's size. A section with nothing to show (no job speculated, none was
compressed, none failed) says so in words instead of drawing an empty plot.

Each section draws in its own colour (`COLORS`), which is also how the report's browser test
finds every plot in a screenshot.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from batchd.report.data import ReportData

COLORS = {
    "throughput": "#1d4ed8",   # generated tokens/s
    "timing": "#ea580c",       # queue wait, prefill, decode
    "lengths": "#16a34a",      # prompt and output tokens
    "acceptance": "#9333ea",   # speculation acceptance by position
    "compression": "#0d9488",  # kept share of the prompt
    "failures": "#dc2626",     # failures by kind
}
JOBS_LINE = "#111827"
NICE_BINS_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400)
MAX_TIME_BINS = 60
HISTOGRAM_BINS = 30
EXAMPLES_PER_KIND = 3
MESSAGE_CHARS = 300


@dataclass
class Section:
    key: str                       # COLORS key; the page's anchor
    title: str
    figure: Optional[go.Figure]    # None: `note` says why there is nothing to plot
    note: str = ""
    stats: list[tuple[str, str]] = field(default_factory=list)   # (label, value) under the plot


def sections(data: ReportData) -> list[Section]:
    return [throughput(data), timing(data), lengths(data), acceptance(data), compression(data), failures(data)]


# ---- throughput over time ------------------------------------------------------------------

def time_bin_seconds(span_s: float, max_bins: int = MAX_TIME_BINS) -> int:
    """The smallest round bin width that cuts `span_s` into at most `max_bins` bins."""
    return next((width for width in NICE_BINS_S if span_s / width <= max_bins), NICE_BINS_S[-1])


def throughput(data: ReportData) -> Section:
    section = Section("throughput", "Throughput over time", None)
    results = [r for r in data.results if r["engine_finished_at"] is not None]
    finished = [j["finished_at"] for j in data.jobs if j["finished_at"] is not None and j["running_at"] is not None]
    if not results and not finished:
        section.note = "No job has finished yet."
        return section
    starts = [r["engine_started_at"] or r["engine_finished_at"] for r in results]
    start = min([*starts, *finished])
    end = max([r["engine_finished_at"] for r in results] + finished)
    width = time_bin_seconds(max((end - start).total_seconds(), 1.0))
    bins = int((end - start).total_seconds() // width) + 1
    tokens = np.zeros(bins)
    for result, started in zip(results, starts):
        spread_over_bins(tokens, (started - start).total_seconds(), (result["engine_finished_at"] - start)
                         .total_seconds(), float(result["generated_tokens"]), width)
    jobs = np.bincount([int((t - start).total_seconds() // width) for t in finished], minlength=bins)[:bins]
    times = [start + timedelta(seconds=i * width) for i in range(bins)]
    figure = make_subplots(specs=[[{"secondary_y": True}]])
    figure.add_bar(x=[t + timedelta(seconds=width / 2) for t in times], y=tokens / width, name="generated tokens/s",
                   marker_color=COLORS["throughput"])
    # the jobs finished by the end of each bin: the batch's progress curve
    figure.add_scatter(x=[t + timedelta(seconds=width) for t in times], y=np.cumsum(jobs), name="jobs finished",
                       mode="lines", line={"color": JOBS_LINE, "width": 2, "shape": "hv"}, secondary_y=True)
    figure.update_yaxes(title_text="generated tokens/s", secondary_y=False, rangemode="tozero")
    figure.update_yaxes(title_text="jobs finished", secondary_y=True, rangemode="tozero", showgrid=False, tickformat=",d")
    figure.update_xaxes(title_text=f"time (UTC), {width} s bins")
    section.figure = _styled(figure)
    p = data.progress
    section.stats = [("generated tokens/s while busy", f"{p.tokens_per_s:,.1f}"),
                     ("prompt + generated tokens/s", f"{p.work_tokens_per_s:,.1f}"),
                     ("peak generated tokens/s", f"{tokens.max() / width:,.1f} ({width} s bin)")]
    return section


def spread_over_bins(bins: np.ndarray, start_s: float, end_s: float, amount: float, width: float) -> None:
    """Add `amount`, spread evenly over [start_s, end_s], to the `width`-second bins it overlaps
    (all of it to end_s's bin when the interval is empty)."""
    last = min(int(end_s // width), len(bins) - 1)
    if end_s <= start_s:
        bins[last] += amount
        return
    rate = amount / (end_s - start_s)
    for b in range(max(int(start_s // width), 0), last + 1):
        overlap = min(end_s, (b + 1) * width) - max(start_s, b * width)
        bins[b] += rate * max(overlap, 0.0)


# ---- distributions --------------------------------------------------------------------------

def percentiles(values: list[float]) -> dict[str, float]:
    array = np.asarray(values, dtype=float)
    return {"median": float(np.median(array)), "p90": float(np.percentile(array, 90)),
            "p99": float(np.percentile(array, 99)), "max": float(array.max())}


def _histogram_bars(values: list[float], value_range: Optional[tuple[float, float]] = None
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(bin centres, counts, widths) of `values` in HISTOGRAM_BINS equal bins over `value_range`
    (default: from the smallest value to the largest)."""
    array = np.asarray(values, dtype=float)
    low, high = value_range or (float(array.min()), float(array.max()))
    if high <= low:
        high = low + max(abs(low) * 0.01, 1e-3)
    counts, edges = np.histogram(array, bins=HISTOGRAM_BINS, range=(low, high))
    return (edges[:-1] + edges[1:]) / 2, counts, np.diff(edges)


def _distribution_figure(panels: list[tuple[str, list[float]]], color: str,
                         value_range: Optional[tuple[float, float]] = None) -> go.Figure:
    figure = make_subplots(rows=1, cols=len(panels), subplot_titles=[title for title, _ in panels])
    most = 0
    for column, (title, values) in enumerate(panels, start=1):
        if values:
            centres, counts, widths = _histogram_bars(values, value_range)
            most = max(most, int(counts.max()))
            figure.add_bar(x=centres, y=counts, width=widths, name=title, marker_color=color, showlegend=False,
                           row=1, col=column)
        figure.update_xaxes(title_text=title, row=1, col=column)
    figure.update_yaxes(title_text="jobs", row=1, col=1)
    figure.update_yaxes(**_whole_numbers(most))
    return _styled(figure)


def _whole_numbers(most: int) -> dict:
    """Axis settings that keep ticks of a count on whole numbers."""
    return {"dtick": 1} if most <= 8 else {"tickformat": ",d"}


def _stats(panels: list[tuple[str, list[float]]], unit: str, fmt: str) -> list[tuple[str, str]]:
    rows = []
    for title, values in panels:
        if values:
            q = percentiles(values)
            rows.append((title, ", ".join(f"{name} {format(v, fmt)}{unit}" for name, v in q.items())))
    return rows


def timing(data: ReportData) -> Section:
    panels = [("queue wait (s)", data.values("queue_wait_s")), ("prefill (s)", data.values("prefill_s")),
              ("decode (s)", data.values("decode_s"))]
    if not data.results:
        return Section("timing", "Queue wait, prefill and decode time", None, "No job has succeeded yet.")
    return Section("timing", "Queue wait, prefill and decode time", _distribution_figure(panels, COLORS["timing"]),
                   stats=_stats(panels, " s", ".2f"))


def lengths(data: ReportData) -> Section:
    panels = [("prompt tokens", data.values("prompt_tokens")), ("output tokens", data.values("generated_tokens"))]
    if not data.results:
        return Section("lengths", "Prompt and output lengths", None, "No job has succeeded yet.")
    return Section("lengths", "Prompt and output lengths", _distribution_figure(panels, COLORS["lengths"]),
                   stats=_stats(panels, "", ",.0f"))


# ---- speculation and compression ------------------------------------------------------------

def acceptance(data: ReportData) -> Section:
    """Per draft position: the mean of the jobs' acceptance rates there, weighted by their
    speculative steps, with the spread of the jobs' own rates (25th to 75th percentile)."""
    section = Section("acceptance", "Speculation acceptance by position", None)
    by_position: dict[int, list[tuple[float, int]]] = defaultdict(list)
    speculated = 0
    for result in data.results:
        rates = result["acceptance_per_position"] or []
        if result["spec_steps"] and rates:
            speculated += 1
            for position, rate in enumerate(rates, start=1):
                by_position[position].append((float(rate), int(result["spec_steps"])))
    if not by_position:
        section.note = "No job used speculative decoding (`--spec lookup` or `--spec draft`)."
        return section
    positions = sorted(by_position)
    means, low, high = [], [], []
    for position in positions:
        rates = np.array([rate for rate, _ in by_position[position]])
        weights = np.array([steps for _, steps in by_position[position]], dtype=float)
        means.append(float(np.average(rates, weights=weights)))
        low.append(float(np.percentile(rates, 25)))
        high.append(float(np.percentile(rates, 75)))
    figure = go.Figure(go.Bar(
        x=positions, y=means, marker_color=COLORS["acceptance"], name="acceptance",
        error_y={"type": "data", "symmetric": False, "array": np.subtract(high, means),
                 "arrayminus": np.subtract(means, low), "color": JOBS_LINE}))
    figure.update_xaxes(title_text="draft position", dtick=1)
    figure.update_yaxes(title_text="P(accepted | offered)", range=[0, 1.05])
    section.figure = _styled(figure)
    section.stats = [("jobs that speculated", f"{speculated:,} of {len(data.results):,}"),
                     ("position 1", f"{means[0]:.1%}")]
    return section


def compression(data: ReportData) -> Section:
    section = Section("compression", "Prompt compression (PFlash)", None)
    ratios = [float(r["compression_ratio"]) for r in data.results if r["compressed"] and r["compression_ratio"]]
    if not ratios:
        section.note = "No job was compressed (`--compress auto` compresses prompts past the threshold)."
        return section
    figure = _distribution_figure([("kept share of the prompt (effective / original tokens)", ratios)],
                                  COLORS["compression"], value_range=(0.0, 1.0))
    figure.update_xaxes(tickformat=".0%")
    section.figure = figure
    q = percentiles(ratios)
    section.stats = [("jobs compressed", f"{len(ratios):,} of {len(data.results):,}"),
                     ("kept", f"median {q['median']:.1%}, p90 {q['p90']:.1%}, max {q['max']:.1%}")]
    return section


# ---- failures -------------------------------------------------------------------------------

@dataclass(frozen=True)
class FailureKind:
    kind: str
    count: int
    examples: list[tuple[str, str]]   # (custom_id, message), the first EXAMPLES_PER_KIND


def failure_kinds(data: ReportData) -> list[FailureKind]:
    counts = Counter(job["error_kind"] or "unknown" for job in data.failures)
    examples: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for job in data.failures:
        kind = job["error_kind"] or "unknown"
        if len(examples[kind]) < EXAMPLES_PER_KIND:
            message = job["error_message"] or ""
            examples[kind].append((job["custom_id"], message if len(message) <= MESSAGE_CHARS
                                   else message[:MESSAGE_CHARS - 1] + "…"))
    return [FailureKind(kind, count, examples[kind]) for kind, count in counts.most_common()]


def failures(data: ReportData) -> Section:
    section = Section("failures", "Failures by kind", None)
    kinds = failure_kinds(data)
    if not kinds:
        section.note = "No job failed."
        return section
    figure = go.Figure(go.Bar(x=[k.count for k in kinds], y=[k.kind for k in kinds], orientation="h",
                              marker_color=COLORS["failures"], name="failed jobs"))
    figure.update_yaxes(autorange="reversed")
    figure.update_xaxes(title_text="failed jobs", rangemode="tozero", **_whole_numbers(max(k.count for k in kinds)))
    section.figure = _styled(figure, height=max(180, 60 + 40 * len(kinds)))
    section.stats = [(k.kind, f"{k.count:,}") for k in kinds]
    return section


def _styled(figure: go.Figure, height: int = 340) -> go.Figure:
    figure.update_layout(template="plotly_white", height=height, margin={"l": 60, "r": 60, "t": 40, "b": 50},
                         legend={"orientation": "h", "y": 1.12}, bargap=0.05, font={"size": 12})
    return figure
