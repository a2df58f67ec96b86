"""`batchd results` (a table for people) and `batchd export` (JSONL or CSV, every column)."""
from __future__ import annotations

import sys
from typing import Optional

import click

from batchd.cli.context import CliContext, echo_err, pass_cli
from batchd.jobs.export import result_rows, write_csv, write_jsonl
from batchd.jobs.openai_export import write_openai
from batchd.jobs.progress import batch_progress

STATUSES = ("pending", "queued", "running", "succeeded", "failed", "cancelled", "expired")


def results_table(rows: list[dict], output_width: int = 48) -> str:
    """custom_id, status, SHA-256 (first 16), tokens, decode tok/s, seconds, and output or error."""
    header = f"{'custom_id':<28} {'status':<9} {'sha256':<16} {'in':>5} {'out':>4} {'tok/s':>6} {'total_s':>7}  output / error"
    lines = [header, "-" * len(header)]
    for r in rows:
        if r["status"] == "succeeded":
            text = r["output_text"]
        elif r["error_kind"]:
            text = f"{r['error_kind']}: {r['error_message'] or ''}"
        else:
            text = ""
        text = " ".join((text or "").split())
        text = text if len(text) <= output_width else text[:output_width - 1] + "…"
        sha = (r["output_sha256"] or "")[:16]
        lines.append(f"{_cut(r['custom_id'], 28):<28} {r['status']:<9} {sha:<16} {_num(r['prompt_tokens']):>5} "
                     f"{_num(r['generated_tokens']):>4} {_num(r['decode_tokens_per_s'], '.1f'):>6} "
                     f"{_num(r['total_s'], '.2f'):>7}  {text}")
    return "\n".join(lines)


def _cut(value: str, width: int) -> str:
    return value if len(value) <= width else "…" + value[-(width - 1):]


def _num(value, fmt: str = "d") -> str:
    return "" if value is None else format(value, fmt)


@click.command("results")
@click.option("--batch", "batch_name", envvar="BATCHD_BATCH", required=True)
@click.option("--format", "fmt", type=click.Choice(["table", "jsonl", "csv"]), default="table", show_default=True)
@click.option("--status", "statuses", type=click.Choice(STATUSES), multiple=True, help="Only jobs in this status.")
@click.option("--output", "-o", type=click.Path(dir_okay=False, writable=True), help="Write here (default stdout).")
@pass_cli
def results(cli: CliContext, batch_name: str, fmt: str, statuses, output: Optional[str]) -> None:
    """One line per job of a batch: status, output SHA-256, tokens, speed, output or error."""
    write(cli, batch_name, fmt, list(statuses), output)


@click.command("export")
@click.option("--batch", "batch_name", envvar="BATCHD_BATCH", required=True)
@click.option("--format", "fmt", type=click.Choice(["jsonl", "csv", "openai"]), default="jsonl", show_default=True,
              help="openai: the OpenAI Batch API's output file, one line per finished job.")
@click.option("--status", "statuses", type=click.Choice(STATUSES), multiple=True, help="Only jobs in this status.")
@click.option("--output", "-o", type=click.Path(dir_okay=False, writable=True), help="Write here (default stdout).")
@pass_cli
def export(cli: CliContext, batch_name: str, fmt: str, statuses, output: Optional[str]) -> None:
    """Every job of a batch with its input, result and telemetry columns, as JSONL or CSV; or
    the OpenAI Batch API's output lines (--format openai)."""
    write(cli, batch_name, fmt, list(statuses), output)


def write(cli: CliContext, batch_name: str, fmt: str, statuses: list[str], output: Optional[str]) -> None:
    settings = cli.database(cli.settings())
    batch_progress(settings.database_url, batch_name)  # a clear error for an unknown batch
    rows = result_rows(settings.database_url, batch_name, statuses)
    out = open(output, "w", encoding="utf-8", newline="") if output else sys.stdout
    try:
        if fmt == "table":
            click.echo(results_table(list(rows)), file=out)
        elif fmt == "jsonl":
            write_jsonl(rows, out)
        elif fmt == "openai":
            _, left_out = write_openai(rows, out)
            if left_out:
                echo_err(f"{left_out} job(s) not finished yet are not in the file (the API's file holds finished "
                         "requests); export again when `batchd status` shows the batch done")
        else:
            write_csv(rows, out)
    finally:
        if output:
            out.close()


COMMANDS = [results, export]
