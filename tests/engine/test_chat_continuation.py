"""`continue_final_message`: a message list that ends with an assistant message is continued
(the prompt stops right after that message's text) instead of opening a new assistant turn,
exactly as transformers' `apply_chat_template(continue_final_message=True)` renders it."""
from __future__ import annotations

import gguf
import pytest

from batchd.engine.errors import BadInputError
from batchd.engine.text import TextCodec
from tests.conftest import smollm2_gguf_path

chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")

# Meta-Llama-3-8B-Instruct's template: it trims every message, so a trailing space of the
# message to continue is not in the rendered text (transformers' second branch)
LLAMA3_TEMPLATE = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
                   "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
                   "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
                   "{{ content }}{% endfor %}{% if add_generation_prompt %}"
                   "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


def smollm2_template() -> str:
    field = gguf.GGUFReader(str(smollm2_gguf_path())).fields["tokenizer.chat_template"]
    return field.contents()


TEMPLATES = {"smollm2": (smollm2_template, "<|im_start|>", "<|im_end|>"),
             "llama3": (lambda: LLAMA3_TEMPLATE, "<|begin_of_text|>", "<|eot_id|>")}
ASSISTANT_STARTS = ["The capital of France is", "The capital of France is ", "  Paris, because", "Line one\nLine"]


@pytest.mark.parametrize("template_name", TEMPLATES)
@pytest.mark.parametrize("start", ASSISTANT_STARTS, ids=["plain", "trailing-space", "leading-spaces", "newline"])
def test_continuation_renders_as_transformers_does(template_name, start):
    load, bos, eos = TEMPLATES[template_name]
    template = load()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"},
                {"role": "assistant", "content": start}]
    codec = TextCodec(tokenizer=None, chat_template=template, bos_token=bos, eos_token=eos)
    ours = codec.render_chat(messages, continue_final_message=True)
    [theirs], _ = chat_template_utils.render_jinja_template(
        conversations=[messages], chat_template=template, continue_final_message=True, bos_token=bos, eos_token=eos)
    assert ours == theirs
    assert ours.rstrip().endswith(start.strip()) and not ours.endswith(eos)


def test_a_new_turn_is_still_the_default():
    template, bos, eos = TEMPLATES["smollm2"]
    codec = TextCodec(tokenizer=None, chat_template=template(), bos_token=bos, eos_token=eos)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert codec.render_chat(messages).endswith("Hello<|im_end|>\n<|im_start|>assistant\n")


def test_a_template_that_drops_the_last_message_cannot_be_continued():
    codec = TextCodec(tokenizer=None, chat_template="{% for m in messages[:-1] %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(BadInputError, match="does not reproduce the last message"):
        codec.render_chat([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                          continue_final_message=True)
