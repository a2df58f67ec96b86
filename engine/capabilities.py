"""What each architecture and placement supports, and the feature gate that enforces it.

The gate runs when a worker starts (for its defaults) and when a job is submitted (for the
job's own options). An unsupported combination raises `UnsupportedFeatureError` naming it; an
accepted option that does nothing here comes back as a note, which reaches the job's telemetry.
Nothing is dropped silently (DESIGN.md section 5, the seeds' HTTP 500 and silent-flag bugs).
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.errors import UnsupportedFeatureError


@dataclass(frozen=True)
class Capabilities:
    speculation: tuple[str, ...]  # methods besides "none"
    compression: bool  # PFlash prompt compression with a drafter
    attention: tuple[str, ...]  # "dense", "sparse"
    devices: tuple[str, ...]
    note: str = ""


CAPABILITIES: dict[str, Capabilities] = {
    "llama": Capabilities(("lookup", "draft"), True, ("dense", "sparse"), ("cpu", "cuda"),
                          "SmolLM2 and Llama 3 (llama3 rope scaling)"),
    "qwen2": Capabilities(("lookup", "draft"), True, ("dense", "sparse"), ("cpu", "cuda"),
                          "Qwen2 / Qwen2.5 (bias on q, k, v)"),
    "qwen3": Capabilities(("lookup", "draft"), True, ("dense", "sparse"), ("cpu", "cuda"),
                          "Qwen3 (RMSNorm on q and k)"),
}


def capabilities_for(architecture: str) -> Capabilities:
    try:
        return CAPABILITIES[architecture]
    except KeyError:
        raise UnsupportedFeatureError(f"no capability row for architecture {architecture!r}") from None


def check_features(architecture: str, device: str, *, spec: str = "none", compress: str = "off",
                   attention: str = "dense", cuda_graphs: bool = False, head_dim: int = 64) -> list[str]:
    """Raise UnsupportedFeatureError for a combination this build cannot run; return notes for
    options that are accepted but have no effect here."""
    caps = capabilities_for(architecture)
    device_type = device.split(":")[0]
    where = f"architecture {architecture} on {device_type}"
    if device_type not in caps.devices:
        raise UnsupportedFeatureError(f"device {device_type!r} is not supported for {architecture}")
    if spec != "none" and spec not in caps.speculation:
        raise UnsupportedFeatureError(f"--spec {spec} is not supported for {where}")
    if compress != "off" and not caps.compression:
        raise UnsupportedFeatureError(f"--compress {compress} is not supported for {where}")
    if attention not in caps.attention:
        raise UnsupportedFeatureError(f"--attention {attention} is not supported for {where}")
    if attention == "sparse" and head_dim & (head_dim - 1):
        raise UnsupportedFeatureError(
            f"--attention sparse needs a power-of-two head_dim; {architecture} has {head_dim}; use dense")
    notes = []
    if cuda_graphs and device_type != "cuda":
        notes.append("CUDA graphs requested but the device is the CPU: steps run eagerly")
    if attention == "sparse" and device_type != "cuda":
        notes.append("sparse attention on the CPU runs the PyTorch reference (slow; for tests)")
    return notes
