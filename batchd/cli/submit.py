"""`batchd submit`: files, folders, globs, stdin or JSONL into a named batch."""
from __future__ import annotations

from datetime import datetime, timezone
from typing import Optional

import click

from batchd.cli.context import CliContext, echo_err, pass_cli
from batchd.cli.options import generation_options, params_from_options, submit_options
from batchd.config import Settings, redact_url
from batchd.embedded import broker_url_for
from batchd.jobs.inputs import DEFAULT_TEMPLATE, read_inputs
from batchd.jobs.publish import Publisher
from batchd.jobs.submit import SubmitReport, submit_jobs
from batchd.queue.broker import broker_problem
from batchd.queue.celery_app import configure


def do_submit(settings: Settings, options: dict, *, publish: bool = True) -> SubmitReport:
    """Shared by `submit` and `run`: read the inputs, write the jobs, publish if a broker runs."""
    params = params_from_options(options)
    template = options["template_file"].read() if options.get("template_file") else (options.get("template")
                                                                                     or DEFAULT_TEMPLATE)
    batch_name = options.get("batch_name") or datetime.now(timezone.utc).strftime("batch-%Y%m%d-%H%M%S")
    inputs = read_inputs(list(options["inputs"]), template=template, fmt=options.get("fmt") or "auto",
                         model_aliases=options.get("model_aliases") or {})
    publisher, broker_away = None, None
    with broker_url_for(settings, start=False) as broker_url:
        if publish and broker_url:
            broker_away = broker_problem(broker_url)   # then the jobs are stored as pending, not lost
            if broker_away is None:
                publisher = Publisher(settings, configure(settings, broker_url))
        report = submit_jobs(settings, batch_name, inputs, defaults=params, model=options.get("job_model"),
                             expires_in_s=options.get("expires_in"), publisher=publisher,
                             replace=bool(options.get("replace")))
        report.unpublished_because = report.unpublished_because or broker_away
    print_report(report, publisher is not None and report.unpublished_because is None,
                 redact_url(broker_url) if broker_url else None)
    return report


def print_report(report: SubmitReport, published: bool, broker: Optional[str] = None) -> None:
    for source, message in report.duplicates:
        echo_err(f"skipped {source}: {message}")
    for custom_id, message in report.rejected:
        echo_err(f"rejected {custom_id}: {message}")
    for custom_id, status in report.replaced:
        echo_err(f"replaced {custom_id}: its input is the new one (the job was {status}; it runs again)")
    for custom_id in report.changed_inputs:
        echo_err(f"kept {custom_id}: the batch already holds this custom_id with a different input; "
                 "submit with --replace to run the new one")
    for custom_id in report.kept_succeeded:
        echo_err(f"kept {custom_id}: it already succeeded with its earlier input, which --replace does not change; "
                 "give the new input another custom_id to run it")
    for api_model, lines in sorted(report.ignored_models.items()):
        echo_err(f"note: body.model {api_model!r} on {lines} line(s) is not a batchd model name; those jobs run on "
                 f"{report.model} (map it with --model-alias {api_model}=NAME)")
    parts = [f"{report.new_jobs} new job(s)"]
    if report.replaced:
        parts.append(f"{len(report.replaced)} replaced")
    if report.rejected:
        parts.append(f"{len(report.rejected)} rejected (failed: bad_input)")
    if report.already_present:
        parts.append(f"{report.already_present} already in the batch")
    if report.duplicates:
        parts.append(f"{len(report.duplicates)} duplicate(s) skipped")
    if report.unpublished_because is not None:
        click.echo(f"batch {report.batch_name}: {', '.join(parts)}; new jobs are stored as pending: the broker "
                   f"{broker} does not answer ({report.unpublished_because}); they run when it is back (a worker's "
                   "relay, or `batchd relay`, publishes them)")
        return
    where = "queued" if published else "pending (a worker's relay publishes them)"
    click.echo(f"batch {report.batch_name}: {', '.join(parts)}; new jobs are {where}")


@click.command("submit")
@submit_options
@generation_options
@click.option("--publish/--no-publish", default=True, help="Publish now (else the relay does).")
@pass_cli
def submit(cli: CliContext, publish: bool, **options) -> None:
    """Submit INPUTS (files, folders, globs, '-' for stdin; *.jsonl lines are jobs) as a batch."""
    settings = cli.database(cli.settings())
    report = do_submit(settings, options, publish=publish)
    if not report.job_ids and report.rejected and not report.already_present and not report.replaced:
        raise click.ClickException("every input was rejected; nothing to run")


COMMANDS = [submit]
