"""batchd installs beside current transformers and Hugging Face's `kernels` package (the import name
our kernels/ folder had before it became batchd.kernels): both import, and `batchd generate` runs."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHECK = """
import json, kernels, transformers, batchd.kernels, batchd.engine
print(json.dumps({"hf_kernels": kernels.__file__, "transformers": transformers.__version__,
                  "ours": batchd.kernels.__file__}))
"""


def test_hf_kernels_and_transformers_import_beside_batchd(tmp_path):
    pytest.importorskip("kernels")   # the test extra installs it with transformers >= 5.25
    out = subprocess.run([sys.executable, "-c", CHECK], cwd=tmp_path, capture_output=True, text=True, check=True)
    found = json.loads(out.stdout)
    assert Path(found["hf_kernels"]).parent.parent.name == "site-packages"    # theirs, not our folder
    assert Path(found["ours"]).parent.name == "kernels" and Path(found["ours"]).parent.parent == ROOT


@pytest.mark.slow
def test_batchd_generate_runs_beside_hf_kernels(smollm2_gguf, tmp_path):
    pytest.importorskip("kernels")
    cmd = [sys.executable, "-c", "import kernels, transformers; from batchd.cli.main import main; main()", "generate",
           "--model", str(smollm2_gguf), "--prompt", "The capital of France is", "--max-new-tokens", "6", "--json"]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["generated_tokens"] == 6 and len(result["output_sha256"]) == 64
