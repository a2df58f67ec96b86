"""A batch's totals in words: what `batchd run` prints at its end, `batchd status` per batch,
and `batchd report` at the top of its page (one wording, so the three agree)."""
from __future__ import annotations

from typing import Optional

from batchd.jobs.progress import BatchProgress

STATUS_ORDER = ("succeeded", "failed", "running", "queued", "pending", "cancelled", "expired")


def format_duration(seconds: Optional[float]) -> str:
    if seconds is None:
        return "--:--"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60:02d}:{rest % 60:02d}"


def status_counts(p: BatchProgress, sep: str = " ") -> str:
    return sep.join(f"{s} {p.counts[s]}" for s in STATUS_ORDER if p.counts.get(s))


def totals_lines(p: BatchProgress) -> list[str]:
    """The batch's totals, as `batchd run` ends and `batchd report` opens."""
    span = "first submit to last result" if p.done else "since the first submit, still running"
    busy = f"; workers busy {format_duration(p.busy_s)}" if p.first_started_at else ""
    compressed = (f" ({p.effective_prompt_tokens:,} after compression)"
                  if p.effective_prompt_tokens != p.prompt_tokens else "")
    return [
        f"batch {p.name}: {p.total:,} jobs: {status_counts(p, ', ') or 'none'}",
        f"wall time {format_duration(p.wall_s)} ({span}{busy})",
        f"tokens: {p.prompt_tokens:,} prompt{compressed}, {p.generated_tokens:,} generated "
        f"({p.tokens_per_s:.1f} generated tok/s while busy)",
        f"{p.documents_per_hour:,.1f} documents/hour ({p.succeeded:,} succeeded)",
    ]
