"""The speculative generation loop: propose, verify in one target forward, keep, roll back.

Phases: (1) prefill the target (exactly as plain decoding does) and the drafter; (2) per step,
propose q <= width tokens after the last accepted token t, run the target once over
[t, d_1 .. d_q] (q + 1 rows), decide (verify.py), and truncate the target's cache to the rows of
t and the accepted drafts; the recovered or bonus token is the next step's t. A step with nothing
to propose is a plain decode step (q = 0). (3) If speculation does not pay, the rest of the job
decodes plainly (adaptive.py).

Greedy output is identical to plain decoding, token for token: every kept row is the row plain
decoding writes (a verify lane computes exactly its decode step, engine.linear / engine.attention),
and every emitted token is the target's argmax after the same prefix.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from batchd.engine.errors import BadInputError
from batchd.engine.generate import TokenOutput, decode_plain, prefill_prompt, synchronize
from batchd.engine.linear import rows_are_invariant
from batchd.engine.sampling import Sampler
from batchd.engine.speculative.adaptive import MAX_WIDTH, WidthPolicy, check_width
from batchd.engine.speculative.drafters import Drafters
from batchd.engine.speculative.proposers import DraftModelProposer, PromptLookupProposer, Proposal, Proposer
from batchd.engine.speculative.stats import SpecStats
from batchd.engine.speculative.verify import Verdict, certified_argmax, rejection_sample, verify_greedy
from batchd.engine.attention import MAX_KERNEL_QUERY_ROWS
from batchd.engine.step import MAX_GRAPH_WIDTH
from batchd.engine.stopping import StopChecker
from batchd.engine.types import SpeculationOptions, Telemetry


def max_width_on(engine) -> int:
    """The widest proposal this engine verifies with rows identical to decode's: on CUDA the
    verify step (q + 1 rows) must fit a captured graph and the invariant kernels (17 rows; the
    sparse attention kernels take 16)."""
    if engine.device.type != "cuda":
        return MAX_WIDTH
    if engine.cache.block_summaries is not None:
        return MAX_KERNEL_QUERY_ROWS - 1
    return MAX_GRAPH_WIDTH - 1


def make_proposer(drafters: Drafters, device, options: SpeculationOptions, sampler: Sampler,
                  telemetry: Telemetry) -> Proposer:
    """The proposer `options` asks for; a draft model comes from the target's `drafters`."""
    if options.method == "lookup":
        if options.drafter_path:
            telemetry.notes.append("--drafter has no effect with --spec lookup")
        return PromptLookupProposer(device)
    if options.method == "draft":
        if not options.drafter_path:
            raise BadInputError("--spec draft needs --drafter PATH (a small model with the target's tokenizer)")
        return DraftModelProposer(drafters.get(options.drafter_path, telemetry), sampler)
    raise BadInputError(f"--spec {options.method!r} is not a method; use none, lookup or draft")


@torch.inference_mode()
def generate_speculative(engine, prompt_ids: list[int], sampler: Sampler, stopper: StopChecker,
                         options: SpeculationOptions, telemetry: Telemetry, *,
                         policy: Optional[WidthPolicy] = None, proposer: Optional[Proposer] = None) -> TokenOutput:
    """`policy` and `proposer` replace the ones `options` implies (tests, benchmarks)."""
    check_width(options.width)
    proposer = proposer or make_proposer(engine.drafters, engine.device, options, sampler, telemetry)
    policy = policy or WidthPolicy(options.width)
    max_width = max_width_on(engine)
    if options.width is not None and options.width > max_width:
        telemetry.notes.append(f"--spec-width {options.width}: this device verifies at most {max_width} drafts "
                               f"per step with rows identical to decode's; width {max_width} used")
    runner, cache, device = engine.runner, engine.cache, engine.device
    stats = SpecStats()

    # 1. prefill the target, as plain decoding does, then the drafter (drafting time)
    started = time.perf_counter()
    logits = prefill_prompt(runner, prompt_ids, engine.prefill_chunk)
    first = sampler.sample(logits[:, -1])  # [1]
    synchronize(device)
    prefill_s = time.perf_counter() - started

    started = time.perf_counter()
    proposer.begin(prompt_ids)
    synchronize(device)
    stats.draft_s += time.perf_counter() - started

    # 2. propose, verify, keep
    generated: list[int] = []
    finish = stopper.accept(generated, first.tolist())
    context = list(prompt_ids) + generated  # its last token is not in the target's cache yet
    clock = policy.clock
    while finish is None and not policy.disabled:
        step_started = clock()
        room = cache.max_len - cache.length - 1  # rows left after the last token's own
        if room < 0:
            finish = "length"
            break
        budget = stopper.max_new_tokens - len(generated) - 1  # a step yields up to q + 1 tokens
        width = min(policy.width(), max_width, room, budget)
        proposal = proposer.propose(context, width) if width > 0 else Proposal(_no_tokens(device))
        synchronize(device)
        drafted = clock()
        verdict = verify_step(runner, sampler, context[-1], proposal)
        proposer.accepted(verdict.accepted)
        before = len(generated)
        finish = stopper.accept(generated, verdict.tokens)
        context += generated[before:]
        done = clock()
        if len(proposal):
            stats.record(len(proposal), verdict.accepted)
            stats.draft_s += drafted - step_started
            stats.verify_s += done - drafted
            policy.record_spec_step(len(proposal), verdict.accepted, len(generated) - before,
                                    done - step_started, drafted - step_started)
        else:
            policy.record_plain_step(done - step_started)

    # 3. speculation switched itself off: plain decoding from the last accepted token
    telemetry.spec_disabled, telemetry.spec_disabled_reason = policy.disabled, policy.disabled_reason
    if finish is None:
        finish = _decode_rest_plainly(runner, sampler, stopper, generated, context[-1])
    synchronize(device)
    stats.fill(telemetry)
    return TokenOutput(generated, finish, prefill_s, time.perf_counter() - started)


def verify_step(runner, sampler: Sampler, last_token: int, proposal: Proposal) -> Verdict:
    """One target forward over [last_token, d_1 .. d_q]; the cache keeps the rows of last_token
    and of the accepted drafts."""
    cache, model = runner.cache, runner.model
    start = cache.length
    last = torch.tensor([last_token], dtype=torch.long, device=cache.device)
    tokens = torch.cat([last, proposal.tokens]).view(1, -1)  # [1, q + 1]
    if sampler.greedy and certifies_head(model):
        # every layer's lanes computed as decode computes them (engine.linear), but the head, a
        # fifth of SmolLM2's weights, as one GEMM whose argmax is certified per lane
        hidden = model(tokens, cache, head=False)[0]  # [q + 1, H]
        verdict = verify_greedy(certified_argmax(hidden, model.lm_head), proposal.tokens)
    else:
        logits = runner.step(tokens)[0]  # [q + 1, V]; a static buffer on CUDA: used before the next step
        if sampler.greedy:
            verdict = verify_greedy(logits.argmax(-1), proposal.tokens)
        else:
            verdict = rejection_sample(sampler.probabilities(logits), proposal.tokens, proposal.probs, sampler)
    cache.truncate(start + 1 + verdict.accepted)
    return verdict


def certifies_head(model) -> bool:
    """Greedy verification takes the head's argmax from one GEMM (verify.certified_argmax): on
    the CPU in float32 where the head's rows are not M-invariant already (engine.linear's
    fallback of one-row products, which would cost q + 1 decode heads)."""
    return (model.device.type == "cpu" and model.dtype == torch.float32 and model.lm_head.bias is None
            and not rows_are_invariant(model.lm_head))


def _decode_rest_plainly(runner, sampler, stopper, generated: list[int], last_token: int) -> str:
    cache = runner.cache
    if cache.length + 1 > cache.max_len:
        return "length"
    logits = runner.step(torch.tensor([[last_token]], dtype=torch.long, device=cache.device))
    return decode_plain(runner, sampler.sample(logits[:, -1]), sampler, stopper, generated)


def _no_tokens(device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.long, device=device)
