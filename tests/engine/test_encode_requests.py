"""TextCodec.encode_requests (many jobs' prompts in one encode_batch) gives each job exactly what
encode_request gives it alone, and a job's bad input stays that job's."""
import pytest

from batchd.engine.errors import BadInputError, EngineError
from batchd.engine.types import GenerationRequest
from batchd.engine.checkpoint.gguf_file import read_gguf
from batchd.engine.checkpoint.gguf_tokenizer import build_tokenizer
from batchd.engine.text import TextCodec


@pytest.fixture(scope="module")
def codec(smollm2_gguf):
    metadata = read_gguf(smollm2_gguf).metadata   # the tokenizer and template only, no weights
    return TextCodec(build_tokenizer(metadata), metadata["tokenizer.chat_template"])


def test_many_prompts_encode_as_each_alone(codec):
    requests = [GenerationRequest(prompt="The capital of France is"),
                GenerationRequest(prompt="Summarise: " + "long text. " * 300, chat=True),
                GenerationRequest(messages=[{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "Name a colour."}]),
                GenerationRequest(messages=[{"role": "user", "content": "Count:"},
                                            {"role": "assistant", "content": "1, 2,"}], continue_final_message=True),
                GenerationRequest(prompt="naïve café ✓ 漢字 🙂")]
    alone = [codec.encode_request(r.prompt, r.messages, r.chat, r.continue_final_message) for r in requests]
    assert codec.encode_requests(requests) == alone
    assert len({len(ids) for ids in alone}) == len(alone)   # the jobs differ: no accidental equality


def test_a_bad_job_fails_alone(codec):
    good = GenerationRequest(prompt="Hello there")
    outcomes = codec.encode_requests([good, GenerationRequest(prompt=""), GenerationRequest(),
                                      GenerationRequest(messages=[{"role": "user"}]), good])
    assert outcomes[0] == outcomes[4] == codec.encode_request("Hello there", None, False)
    for bad in outcomes[1:4]:
        assert isinstance(bad, BadInputError) and isinstance(bad, EngineError)
