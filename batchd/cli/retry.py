"""`batchd retry`: run failed, expired or cancelled jobs again, optionally with other params."""
from __future__ import annotations

import click

from batchd.cli.context import CliContext, echo_err, pass_cli
from batchd.cli.options import override_options, params_from_options
from batchd.db.models import ERROR_KINDS, JobStatus
from batchd.embedded import broker_url_for
from batchd.jobs.manage import retry as retry_jobs
from batchd.jobs.publish import Publisher
from batchd.queue.celery_app import configure


@click.command("retry")
@click.argument("job_ids", nargs=-1, type=int)
@click.option("--batch", "batch_name", envvar="BATCHD_BATCH", help="Retry jobs of this batch.")
@click.option("--status", "statuses", type=click.Choice(["failed", "expired", "cancelled"]), multiple=True,
              help="Which finished states to retry (default: failed and expired).")
@click.option("--kind", "error_kind", type=click.Choice(ERROR_KINDS), help="Only failed jobs of this error kind.")
@override_options
@pass_cli
def retry(cli: CliContext, job_ids: tuple[int, ...], batch_name, statuses, error_kind, **options) -> None:
    """Put finished jobs back to pending (errors cleared; each job's events keep them) and publish
    them. Generation options given here override the jobs' own params, e.g. `--kind too_long
    --compress auto`."""
    if not job_ids and not batch_name:
        raise click.UsageError("give --batch NAME or job ids")
    settings = cli.database(cli.settings())
    chosen = [JobStatus(s) for s in statuses] or [JobStatus.FAILED, JobStatus.EXPIRED]
    overrides = params_from_options(options)
    report = retry_jobs(settings.database_url, batch=batch_name, job_ids=job_ids if not batch_name else None,
                        statuses=chosen, error_kind=error_kind, params=overrides)
    for custom_id, why in report.not_retried:
        echo_err(f"not retried {custom_id}: {why}; fix its input and submit it again with --replace")
    published = 0
    with broker_url_for(settings, start=False) as broker_url:
        if report.retried and broker_url:
            published = Publisher(settings, configure(settings, broker_url)).publish_pending(report.retried)
    with_params = f" with {', '.join(f'{k}={v!r}' for k, v in overrides.items())}" if overrides else ""
    click.echo(f"retrying {len(report.retried)} job(s){with_params}; {published} queued now, "
               "the rest when a relay runs")
    if report.not_retried and not report.retried:
        raise click.ClickException("no job could be retried")


COMMANDS = [retry]
