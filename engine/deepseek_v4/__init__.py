"""DeepSeek V4 (`deepseek_v4`) as transformers defines it, in the engine's style (docs/deepseek_v4.md).

    model, aside = load_folder("/models/tiny-v4")          # config.json + safetensors
    cache = model.new_cache(max_len=4096)
    logits = model(torch.tensor([prompt_ids]), cache)      # prefill; then decode or verify rows
    cache.truncate(n)                                      # roll a rejected draft back

The modules: config (V4Config), rope (partial interleaved, main / compress families), attention
(sliding window + compressed entries + sinks), compressor (CSA/HCA entries, the indexer's top-k),
moe (routed + shared experts, hash routing), hyper_connections (mHC), model (DeepseekV4), cache
(V4Cache), weights (checkpoint names), mtp (the MTP layer: `--spec draft`'s drafter); paged (the
cache in the batch engine's blocks), batch (V4BatchEngine over the batch Scheduler), serving
(V4Engine: what Engine.load returns for a V4 folder, text in and out, as the worker uses it).
"""
from batchd.engine.deepseek_v4.cache import V4Cache
from batchd.engine.deepseek_v4.config import V4Config
from batchd.engine.deepseek_v4.model import DeepseekV4, build_model, generate_greedy, load_folder
from batchd.engine.deepseek_v4.weights import load_tensors

__all__ = ["DeepseekV4", "V4Cache", "V4Config", "build_model", "generate_greedy", "load_folder", "load_tensors"]
