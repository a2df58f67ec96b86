"""Build a `tokenizers.Tokenizer` from a GGUF file's tokenizer metadata.

GGUF stores the vocabulary (`tokenizer.ggml.tokens`), the BPE merges, a type per token
(1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte) and the name of the
pre-tokenizer (`tokenizer.ggml.pre`), which llama.cpp maps to a list of split regexes.
We rebuild the same pipeline as the model's original tokenizer.json: byte-level BPE, a
pre-tokenizer per `pre`, control and user-defined tokens as added tokens (control ones are
special), and a BOS template when the file says `add_bos_token`.

Only "gpt2" (byte-level BPE) vocabularies are supported: that covers Llama 3, Qwen 2/2.5/3 and
SmolLM. SentencePiece ("llama") vocabularies are refused with a message.
"""
from __future__ import annotations

from typing import Optional

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4

# The split regexes of llama.cpp (llama-vocab.cpp), written as the original tokenizer.json had them.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> our pre-tokenizer family (names as llama.cpp accepts them)
PRE_TOKENIZER_FAMILIES = {
    "llama3": "llama3", "llama-v3": "llama3", "llama-bpe": "llama3", "smaug-bpe": "llama3",
    "dbrx": "llama3",
    "qwen2": "qwen2", "deepseek-r1-qwen": "qwen2", "megrez": "qwen2", "stablelm2": "qwen2",
    "smollm": "digits+gpt2", "starcoder": "digits+gpt2", "refact": "digits+gpt2",
    "codeshell": "digits+gpt2",
    "gpt-2": "gpt2", "gpt2": "gpt2", "mpt": "gpt2", "olmo": "gpt2", "phi-2": "gpt2",
}
# llama.cpp turns BOS on for these families when the file does not say
_ADD_BOS_DEFAULT = {"llama3": True}


class GGUFTokenizerError(ValueError):
    """The loader turns this into a CheckpointError naming the file."""


def build_tokenizer(metadata: dict) -> Tokenizer:
    """A byte-level BPE `Tokenizer` equivalent to the model's original tokenizer.json."""
    model_kind = metadata.get("tokenizer.ggml.model")
    if model_kind != "gpt2":
        raise GGUFTokenizerError(
            f"tokenizer model {model_kind!r} is not supported: from GGUF, batchd reads byte-level "
            f"BPE ('gpt2') vocabularies only; load the model's Hugging Face folder instead")
    tokens: list[str] = metadata.get("tokenizer.ggml.tokens") or []
    merges: list[str] = metadata.get("tokenizer.ggml.merges") or []
    if not tokens:
        raise GGUFTokenizerError("no tokenizer.ggml.tokens in the metadata")
    for key, values in (("tokenizer.ggml.tokens", tokens), ("tokenizer.ggml.merges", merges)):
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise GGUFTokenizerError(f"{key} must be a list of strings; the file is corrupt")
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(token_types) != len(tokens):
        raise GGUFTokenizerError(
            f"tokenizer.ggml.token_type has {len(token_types)} entries for {len(tokens)} tokens")
    pre = metadata.get("tokenizer.ggml.pre") or "default"
    family = "gpt2" if pre == "default" else PRE_TOKENIZER_FAMILIES.get(pre)
    if family is None:
        raise GGUFTokenizerError(
            f"pre-tokenizer {pre!r} is not supported; known: {', '.join(sorted(PRE_TOKENIZER_FAMILIES))}")

    vocab = {token: index for index, token in enumerate(tokens)}
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise GGUFTokenizerError(f"malformed merge {merge!r} in tokenizer.ggml.merges")
        pairs.append((left, right))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=family == "llama3",
                                     fuse_unk=False, byte_fallback=False))
    _set_pipeline(tokenizer, family)
    _add_tokens(tokenizer, tokens, token_types)
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", _ADD_BOS_DEFAULT.get(family, False)))
    bos_id = metadata.get("tokenizer.ggml.bos_token_id")
    if add_bos and not (isinstance(bos_id, int) and 0 <= bos_id < len(tokens)):
        raise GGUFTokenizerError(f"tokenizer.ggml.bos_token_id is {bos_id!r}, but the vocabulary has {len(tokens)} "
                                 f"tokens; the file is corrupt")
    _set_post_processor(tokenizer, tokens, bos_id if add_bos else None)
    return tokenizer


def _set_pipeline(tokenizer: Tokenizer, family: str) -> None:
    if family == "llama3":
        split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False)
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif family == "qwen2":
        tokenizer.normalizer = normalizers.NFC()
        split = pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False)
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif family == "digits+gpt2":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()


def _add_tokens(tokenizer: Tokenizer, tokens: list[str], token_types: list[int]) -> None:
    # Added tokens are matched in the raw text before pre-tokenisation, as llama.cpp does.
    special = [AddedToken(tokens[i], special=True, normalized=False)
               for i, kind in enumerate(token_types) if kind == TOKEN_CONTROL]
    user = [AddedToken(tokens[i], special=False, normalized=False)
            for i, kind in enumerate(token_types) if kind == TOKEN_USER_DEFINED]
    if special:
        tokenizer.add_special_tokens(special)
    if user:
        tokenizer.add_tokens(user)


def _set_post_processor(tokenizer: Tokenizer, tokens: list[str], bos_id: Optional[int]) -> None:
    byte_level = processors.ByteLevel(trim_offsets=False)
    if bos_id is None:
        tokenizer.post_processor = byte_level
        return
    bos = tokens[bos_id]
    template = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)])
    tokenizer.post_processor = processors.Sequence([byte_level, template])


def control_token_ids(metadata: dict) -> set[int]:
    types = metadata.get("tokenizer.ggml.token_type") or []
    return {i for i, kind in enumerate(types) if kind == TOKEN_CONTROL}
