"""Which kernel of a fused decode step asks L2 for which later weight (kernels.l2_prefetch).

A schedule is a list of `host=target[:MB]` items: while kernel `host` of layer i runs, its programs
request the next MB megabytes (all of it without :MB) of weight `target` that no earlier item of
the layer took. Hosts are the layer's launches that take a range: qkv, attn (the attention split
kernel), o, gate_up, down (its split kernel). Targets are that layer's o, gate_up, down, or the
next layer's qkv and o (next_qkv, next_o; nothing for the last layer). For example

    qkv=o,attn=gate_up:16,down=next_qkv

asks, during qkv, for the o weight; during attention, for gate/up's first 16 MB; during down, for
the next layer's qkv weight. The bytes requested change no value: only where the next kernel finds
its weights. `BATCHD_L2_PREFETCH` overrides the schedule ("off": none).
"""
from __future__ import annotations

import os
from typing import Optional

import torch

HOSTS = ("qkv", "attn", "o", "gate_up", "down")
TARGETS = ("o", "gate_up", "down", "next_qkv", "next_o")
DEFAULT_SCHEDULE = "off"

LayerPrefetch = dict[str, torch.Tensor]   # host -> uint8 byte range (kernels.l2_prefetch.weight_range)


def parse_schedule(spec: str) -> list[tuple[str, str, Optional[float]]]:
    """'host=target[:MB],...' -> [(host, target, MB or None)]; ValueError naming the bad item."""
    spec = spec.strip()
    if spec in ("", "off", "none", "0"):
        return []
    items = []
    for item in spec.split(","):
        host, sep, rest = item.strip().partition("=")
        target, _, megabytes = rest.partition(":")
        if not sep or host not in HOSTS or target not in TARGETS:
            raise ValueError(f"L2 prefetch item {item!r}: expected host=target[:MB] with host in {HOSTS} "
                             f"and target in {TARGETS}")
        try:
            size = float(megabytes) if megabytes else None
        except ValueError:
            raise ValueError(f"L2 prefetch item {item!r}: MB must be a number") from None
        items.append((host, target, size))
    return items


def schedule_spec() -> str:
    return os.environ.get("BATCHD_L2_PREFETCH", DEFAULT_SCHEDULE)


def layer_weights(layer) -> dict[str, torch.Tensor]:
    return {"qkv": layer.self_attn.qkv_proj.weight, "o": layer.self_attn.o_proj.weight,
            "gate_up": layer.mlp.gate_up_proj.weight, "down": layer.mlp.down_proj.weight}


def prefetch_plan(layers, spec: str) -> Optional[list[LayerPrefetch]]:
    """Per layer, host -> the byte range its kernel requests; None when the schedule is empty or
    the weights' device cannot prefetch (kernels.l2_prefetch.prefetch_enabled)."""
    from kernels.l2_prefetch import prefetch_enabled, weight_range

    items = parse_schedule(spec)
    if not items or not prefetch_enabled(layers[0].self_attn.qkv_proj.weight.device):
        return None
    plan = []
    for i, layer in enumerate(layers):
        weights = {name: w.detach() for name, w in layer_weights(layer).items()}
        if i + 1 < len(layers):
            following = layer_weights(layers[i + 1])
            weights["next_qkv"], weights["next_o"] = following["qkv"].detach(), following["o"].detach()
        taken = dict.fromkeys(weights, 0)      # bytes of each target already given to a host
        ranges: LayerPrefetch = {}
        for host, target, megabytes in items:
            if target not in weights:
                continue
            start = taken[target]
            stop = None if megabytes is None else start + int(megabytes * 1e6)
            view = weight_range(weights[target], start, stop)
            if view is None:
                continue
            taken[target] = start + view.numel()
            if host in ranges:   # a launch takes one range
                raise ValueError(f"L2 prefetch schedule {spec!r} gives host {host!r} two ranges")
            ranges[host] = view
        plan.append(ranges)
    return plan


__all__ = ["prefetch_plan", "parse_schedule", "schedule_spec", "HOSTS", "TARGETS", "DEFAULT_SCHEDULE", "LayerPrefetch"]
