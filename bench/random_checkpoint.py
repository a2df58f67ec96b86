"""Write a Hugging Face folder of random weights at a real model's shape, with a real tokenizer.

Real weights do not fit what travels to the GPU machine; speed and the service path do not
depend on weight values. The folder loads like any checkpoint (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json with the chat template).

    python bench/random_checkpoint.py --preset smollm2-135m --tokenizer-from model.gguf --out /tmp/rand
    python bench/random_checkpoint.py --preset smollm2-135m --tokenizer-dir .carry/tok --out /tmp/rand
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchd.engine.model import unfuse_hf_tensors  # noqa: E402
from batchd.engine.presets import hf_config_dict, preset  # noqa: E402
from batchd.engine.runtime import build_model  # noqa: E402


def export_tokenizer(checkpoint: str, out: Path) -> None:
    """tokenizer.json + tokenizer_config.json (chat template, bos/eos) from any checkpoint we load."""
    from batchd.engine.checkpoint import load_checkpoint

    ckpt = load_checkpoint(checkpoint)
    out.mkdir(parents=True, exist_ok=True)
    ckpt.tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": ckpt.chat_template, "bos_token": ckpt.bos_token, "eos_token": ckpt.eos_token}))


def write_checkpoint(preset_name: str, tokenizer_dir: Path, out: Path, device: str, seed: int) -> None:
    config = preset(preset_name)
    model = build_model(config, device, torch.bfloat16, seed=seed)
    state = {name: value.detach().cpu() for name, value in model.state_dict().items()}
    tensors = {name: value.contiguous() for name, value in unfuse_hf_tensors(state, config).items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = hf_config_dict(config)
    cfg.update(torch_dtype="bfloat16")
    tokenizer_config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    eos = tokenizer_config.get("eos_token")
    eos_id = next((t["id"] for t in vocab.get("added_tokens", []) if t["content"] == eos), None)
    cfg.update(eos_token_id=eos_id)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--tokenizer-from", help="a checkpoint (GGUF or HF folder) to take the tokenizer from")
    parser.add_argument("--tokenizer-dir", help="a folder with tokenizer.json and tokenizer_config.json")
    parser.add_argument("--tokenizer-only", action="store_true", help="export the tokenizer to --out and stop")
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.out)
    if args.tokenizer_from:
        tokenizer_dir = out if args.tokenizer_only else out / "_tokenizer"
        export_tokenizer(args.tokenizer_from, tokenizer_dir)
        if args.tokenizer_only:
            return
    else:
        tokenizer_dir = Path(args.tokenizer_dir)
    write_checkpoint(args.preset, tokenizer_dir, out, args.device, args.seed)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
