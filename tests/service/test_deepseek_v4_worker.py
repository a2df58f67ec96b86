"""A DeepSeek V4 folder served by a real worker: `batchd run` (SQLite, the embedded broker, relay
and worker) finishes a batch of V4 jobs, and a PFlash job with no dense drafter (V4 cannot score
prompts for itself) fails alone with the reason."""
from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("transformers without deepseek_v4 (needs >= 5.8)", allow_module_level=True)

from tests.engine.test_checkpoint_builders import tiny_tokenizer, write_hf_folder  # noqa: E402
from tests.engine.test_deepseek_v4 import reference_model  # noqa: E402
from tests.service.conftest import batchd_cli, service_env  # noqa: E402


@pytest.mark.slow
def test_a_worker_runs_a_batch_of_v4_jobs(tmp_path):
    folder = write_hf_folder(tmp_path / "v4", reference_model(vocab_size=320), tiny_tokenizer(320))
    env = service_env(f"sqlite:///{tmp_path / 'data' / 'batchd.db'}", None, tmp_path / "data", "batchd",
                      BATCHD_MODEL=str(folder), BATCHD_DEVICE="cpu")
    jobs = [{"custom_id": "plain", "prompt": "The capital of France is"},
            {"custom_id": "lookup", "prompt": "one two three one two three one two", "params": {"spec": "lookup"}},
            {"custom_id": "pflash", "prompt": "Summarise this", "params": {"compress": "always"}}]
    out = batchd_cli(["run", "-", "--batch", "v4", "--max-new-tokens", "5", "--format", "jsonl"], env,
                     input="\n".join(json.dumps(j) for j in jobs).encode(), timeout=300)
    stdout, stderr = out.stdout.decode(), out.stderr.decode()
    assert "Traceback" not in stderr, stderr
    assert "batch v4: 3 jobs: succeeded 2, failed 1" in stdout, stdout + stderr
    rows = {line.split()[0]: line for line in stdout.splitlines() if line.split()[:1] in (["plain"], ["lookup"],
                                                                                          ["pflash"])}
    assert "succeeded" in rows["plain"] and "succeeded" in rows["lookup"]
    assert "failed" in rows["pflash"] and "bad_input: --compress-drafter" in rows["pflash"]
