"""`batchd generate`: one prompt through the engine, no queue and no database."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import click

from batchd.cli.options import generation_options, params_from_options
from batchd.engine.drafter_names import DrafterCatalog, parse_drafter_path
from batchd.jobs.inputs import decode_text
from batchd.jobs.job_request import resolve_drafters
from batchd.jobs.params import build_request


@click.command("generate")
@click.option("--model", "model_path", type=click.Path(), envvar="BATCHD_MODEL", required=True,
              help="Checkpoint: a GGUF file or a Hugging Face folder.")
@click.option("--prompt", help="The prompt text.")
@click.option("--prompt-file", type=click.Path(dir_okay=False), help="Read the prompt from a UTF-8 file.")
@click.option("--device", envvar="BATCHD_DEVICE", default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option("--dtype", envvar="BATCHD_DTYPE", help="float32, bfloat16 or float16 (default: by device).")
@click.option("--max-context", type=int, help="KV cache rows (default: the model's, at most 8192).")
@click.option("--attention", type=click.Choice(["dense", "sparse"]), default="dense", show_default=True,
              help="sparse: top-k key blocks past 2 x budget rows (faster at 128K; may change outputs).")
@click.option("--sparse-top-k-blocks", type=int, default=64, show_default=True, help="Sparse budget in 64-row blocks.")
@generation_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (text, token ids, SHA, telemetry).")
def generate(model_path: str, prompt: Optional[str], prompt_file: Optional[str], device: str, dtype: Optional[str],
             max_context: Optional[int], attention: str, sparse_top_k_blocks: int, as_json: bool, **options) -> None:
    """Generate from one prompt with the engine and print the text (or --json)."""
    if (prompt is None) == (prompt_file is None):
        raise click.UsageError("give exactly one of --prompt and --prompt-file")
    if prompt_file is not None:
        path = Path(prompt_file)
        if not path.exists():
            raise click.ClickException(f"no such file: {prompt_file}")
        prompt, error = decode_text(path.read_bytes())
        if error:
            raise click.ClickException(f"{prompt_file}: {error}")
    if not Path(model_path).exists():
        raise click.ClickException(f"no checkpoint at {model_path}: give --model PATH (a GGUF file or a HF folder)")
    params = params_from_options(options)
    from batchd.engine.deepseek_v4.serving import is_v4_folder
    from batchd.engine.runtime import Engine, EngineConfig

    # a V4 folder drafts with its own MTP layer (--spec draft needs no --drafter; the engine
    # refuses it, with the reason, for a V4 checkpoint that has none)
    request = build_request(prompt, None, params, own_drafter=is_v4_folder(model_path))
    request = resolve_drafters(request, local_drafters(params))

    engine = Engine.load(model_path, EngineConfig(device=device, dtype=dtype, max_context=max_context,
                         attention=attention, sparse_top_k_blocks=sparse_top_k_blocks))
    result = engine.generate(request)
    if as_json:
        click.echo(json.dumps(result.as_dict(), ensure_ascii=False))
        return
    click.echo(result.text)
    t = result.telemetry
    click.echo(f"[{result.prompt_tokens} prompt tokens, {result.generated_tokens} generated, "
               f"{t.decode_tokens_per_s:.1f} tok/s, sha256 {result.output_sha256}]", err=True)


def local_drafters(params: dict) -> DrafterCatalog:
    """`generate` runs on the person's own host, so its --drafter and --compress-drafter are
    paths: each is named in `params` (as a job names one) and put in the catalog under it."""
    named = {}
    for key in ("drafter", "compress_drafter"):
        if key in params:
            path, layers = parse_drafter_path(params[key])
            if not Path(path).exists():
                raise click.ClickException(f"--{key.replace('_', '-')}: no checkpoint at {path}")
            name = key.replace("_", "-")
            named[name] = path
            params[key] = name if layers is None else f"{name}#layers={layers}"
    return DrafterCatalog(named)


COMMANDS = [generate]
