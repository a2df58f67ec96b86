"""Options several commands share. Each reads a BATCHD_* environment variable too."""
from __future__ import annotations

import re
from typing import Any, Callable, Optional

import click

from batchd.config import MODEL_NAME_PATTERN
from batchd.jobs.params import COMPRESS_MODES, SPEC_METHODS

GENERATION_OPTIONS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop", "ignore_eos", "chat",
                      "spec", "drafter", "spec_width", "compress", "compress_threshold", "keep_ratio",
                      "compress_drafter")


def _stack(*decorators: Callable) -> Callable:
    def apply(func: Callable) -> Callable:
        for decorator in reversed(decorators):
            func = decorator(func)
        return func
    return apply


def generation_options(func: Callable) -> Callable:
    """Sampling, speculation and compression; unset ones keep the engine's defaults. Each also
    reads its BATCHD_* variable where it has one."""
    return _stack(*_generation_options(with_env=True))(func)


def override_options(func: Callable) -> Callable:
    """The generation options as overrides of jobs' own params (`retry`): only what is given on
    the command line, never an environment variable."""
    return _stack(*_generation_options(with_env=False))(func)


def _generation_options(with_env: bool) -> list[Callable]:
    def env(name: str) -> dict[str, str]:
        return {"envvar": name} if with_env else {}
    return [
        click.option("--max-new-tokens", type=int, **env("BATCHD_MAX_NEW_TOKENS"), help="Tokens to generate at most."),
        click.option("--temperature", type=float, **env("BATCHD_TEMPERATURE"), help="0 is greedy."),
        click.option("--top-k", type=int, help="Keep the k most likely tokens (0: off)."),
        click.option("--top-p", type=float, help="Nucleus sampling mass in (0, 1]."),
        click.option("--seed", type=int, help="Sampling seed."),
        click.option("--stop", multiple=True, help="Stop string (repeatable)."),
        click.option("--ignore-eos", is_flag=True, default=None, help="Keep going past end-of-sequence."),
        click.option("--chat/--no-chat", default=None, help="Apply the model's chat template."),
        click.option("--spec", type=click.Choice(SPEC_METHODS), **env("BATCHD_SPEC"), help="Speculative decoding."),
        click.option("--drafter", **env("BATCHD_DRAFTER"),
                     help="Drafter for --spec draft: a name the workers serve (--drafter-checkpoint NAME=PATH, or "
                          "their model name), '#layers=N' for its first N layers (`generate`: a path)."),
        click.option("--spec-width", type=int, help="Draft tokens per step (default: adaptive)."),
        click.option("--compress", type=click.Choice(COMPRESS_MODES), **env("BATCHD_COMPRESS"),
                     help="PFlash prompt compression."),
        click.option("--compress-threshold", type=int, help="Compress prompts of at least this many tokens."),
        click.option("--keep-ratio", type=float, help="Share of the prompt PFlash keeps."),
        click.option("--compress-drafter", **env("BATCHD_COMPRESS_DRAFTER"),
                     help="Drafter that scores the prompt for PFlash: a name the workers serve (`generate`: a path)."),
    ]


def params_from_options(options: dict[str, Any]) -> dict[str, Any]:
    """The `params` object from generation options that were given."""
    params = {}
    for name in GENERATION_OPTIONS:
        value = options.pop(name, None)
        if value is None or value == ():
            continue
        params[name] = list(value) if name == "stop" else value
    return params


MODEL_OPTIONS = ("model_path", "model_name", "device", "dtype", "max_context", "attention", "sparse_top_k_blocks",
                 "max_jobs", "drafters")


def model_options(func: Callable) -> Callable:
    """The model a worker serves (`MODEL_OPTIONS`; batchd.cli.worker.model_settings reads them)."""
    return _stack(
        click.option("--model", "model_path", type=click.Path(), envvar="BATCHD_MODEL",
                     help="Checkpoint: a GGUF file or a Hugging Face folder (default: SmolLM2-135M-Instruct)."),
        click.option("--model-name", envvar="BATCHD_MODEL_NAME",
                     help="Name jobs use to reach this model; its queue is <prefix>.<name>."),
        click.option("--device", envvar="BATCHD_DEVICE", help="cpu, cuda or cuda:N (default cpu)."),
        click.option("--dtype", envvar="BATCHD_DTYPE", help="float32, bfloat16 or float16 (default: by device)."),
        click.option("--max-context", type=int, envvar="BATCHD_MAX_CONTEXT", help="KV cache rows (default: model's)."),
        click.option("--max-jobs", type=int, envvar="BATCHD_MAX_JOBS",
                     help="Jobs in flight in this worker's batch (default: what its KV pool fits of 4K-token jobs)."),
        click.option("--attention", type=click.Choice(["dense", "sparse"]), envvar="BATCHD_ATTENTION",
                     help="Decode/verify attention: dense (default; exact) or sparse top-k key blocks past "
                          "2 x budget rows (faster at 128K, may change outputs)."),
        click.option("--sparse-top-k-blocks", type=int, envvar="BATCHD_SPARSE_TOP_K_BLOCKS",
                     help="Sparse budget: 64-row key blocks kept per lane (default 64)."),
        click.option("--drafter-checkpoint", "drafters", multiple=True, metavar="NAME=PATH",
                     help="A drafter jobs may name (repeatable; BATCHD_DRAFTERS='a=PATH,b=PATH'); the model itself "
                          "is one under its --model-name. Jobs never name paths."),
    )(func)


ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


def unescape_template(_ctx, _param, value: Optional[str]) -> Optional[str]:
    """`--template "Summarise:\\n\\n{document}"` means two real newlines, as a person typing it
    in a shell means: a shell's double quotes keep the backslash. `\\n`, `\\t` and `\\\\` are
    understood; any other backslash stays as it is."""
    if value is None:
        return None
    return re.sub(r"\\([nt\\])", lambda m: ESCAPES[m.group(1)], value)


def submit_options(func: Callable) -> Callable:
    return _stack(
        click.argument("inputs", nargs=-1, required=True),
        click.option("--batch", "batch_name", envvar="BATCHD_BATCH",
                     help="Batch name; submitting again under it adds only new custom_ids."),
        click.option("--template", default=None, callback=unescape_template,
                     help="Prompt around each document file; {document} marks its text; \\n is a newline."),
        click.option("--template-file", type=click.File("r", encoding="utf-8"), help="Read the template from a file."),
        click.option("--format", "fmt", type=click.Choice(["auto", "jsonl", "text"]), default="auto", show_default=True,
                     help="auto: *.jsonl files and stdin starting with '{' are JSONL; the rest are documents."),
        click.option("--expires-in", type=float, help="Seconds a job may wait to start before it expires."),
        click.option("--job-model", help="Model name for these jobs (default: the configured model name)."),
        click.option("--replace", is_flag=True,
                     help="A custom_id the batch holds with another input gets the new input (jobs that have not "
                          "succeeded run again; succeeded ones are kept and listed)."),
        click.option("--model-alias", "model_aliases", multiple=True, callback=_parse_model_aliases,
                     metavar="API_MODEL=NAME",
                     help="Run OpenAI batch lines whose body.model is API_MODEL on batchd model NAME (repeatable; "
                          "unmapped body.model names are ignored with a note)."),
    )(func)


def _parse_model_aliases(ctx, param, values) -> dict[str, str]:
    aliases = {}
    for value in values:
        api_model, sep, name = value.partition("=")
        if not sep or not api_model or not MODEL_NAME_PATTERN.match(name):
            raise click.BadParameter(f"{value!r}: write API_MODEL=NAME, NAME a batchd model name "
                                     "(letters, digits, '.', '_', '-')", ctx=ctx, param=param)
        aliases[api_model] = name
    return aliases
