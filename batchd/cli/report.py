"""`batchd report`: a batch as one self-contained HTML page of plots and totals."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import click

from batchd.cli.context import CliContext, pass_cli


def default_report_path(batch: str) -> Path:
    return Path(f"report-{re.sub(r'[^A-Za-z0-9._-]+', '-', batch).strip('-.') or 'batch'}.html")


@click.command("report")
@click.option("--batch", "batch_name", envvar="BATCHD_BATCH", required=True, help="The batch to report on.")
@click.option("--output", "-o", type=click.Path(dir_okay=False, writable=True, path_type=Path),
              help="HTML file to write (default: report-<batch>.html here).")
@pass_cli
def report(cli: CliContext, batch_name: str, output: Optional[Path]) -> None:
    """Write an HTML report of a batch (throughput, timing and length distributions, speculation,
    compression, failures, totals) that opens in any browser without a network."""
    from batchd.report.data import report_data   # plotly loads only for this command
    from batchd.report.page import render_report
    from batchd.report.totals import totals_lines

    settings = cli.database(cli.settings())
    data = report_data(settings.database_url, batch_name)
    path = output or default_report_path(batch_name)
    path.write_text(render_report(data), encoding="utf-8")
    click.echo("\n".join(totals_lines(data.progress)))
    click.echo(f"report: {path.resolve()}")


COMMANDS = [report]
