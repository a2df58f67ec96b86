"""`batchd relay`: publish pending jobs and recover lost ones, in a loop (or once)."""
from __future__ import annotations

import signal
import threading

import click

from batchd.cli.context import CliContext, echo_err, pass_cli
from batchd.embedded import broker_url_for
from batchd.jobs.publish import Publisher
from batchd.queue.celery_app import configure
from batchd.relay import Relay, show_relay_logs


@click.command("relay")
@click.option("--once", is_flag=True, help="One pass, then exit.")
@click.option("--model-name", envvar="BATCHD_MODEL_NAME", help="Model for jobs inserted without one.")
@click.option("--metrics-port", type=int, envvar="BATCHD_METRICS_PORT",
              help="Serve Prometheus metrics (jobs by state, queue depth, what the relay did) on this port.")
@pass_cli
def relay(cli: CliContext, once: bool, model_name, metrics_port) -> None:
    """Move pending jobs onto their queues; requeue jobs whose worker or message was lost."""
    settings = cli.database(cli.settings(model_name=model_name, metrics_port=metrics_port))
    show_relay_logs()
    with broker_url_for(settings, start=True) as broker_url:
        the_relay = Relay(settings, Publisher(settings, configure(settings, broker_url)))
        if once:
            click.echo(f"relay: {the_relay.run_once()}")
            return
        if settings.metrics_port is not None:
            from batchd.metrics import RelayMetrics

            the_relay.metrics = RelayMetrics(settings.database_url, the_relay.queue_depths)
            echo_err(f"metrics on :{the_relay.metrics.serve(settings.metrics_port)}/metrics")
        stop = threading.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
        echo_err(f"relay running every {settings.relay_interval_s:g} s (Ctrl-C stops)")
        the_relay.run_forever(stop)


COMMANDS = [relay]
