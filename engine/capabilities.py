"""What each architecture and placement supports, and the feature gate that enforces it.

The gate runs when a worker starts (for its defaults) and when a job is submitted (for the
job's own options). An unsupported combination raises `UnsupportedFeatureError` naming it; an
accepted option that does nothing here comes back as a note, which reaches the job's telemetry.
Nothing is dropped silently (docs/design.md section 5, the seeds' HTTP 500 and silent-flag bugs).
"""
from __future__ import annotations

from batchd.engine.architectures import ARCHITECTURES, Capabilities
from batchd.engine.errors import UnsupportedFeatureError

__all__ = ["Capabilities", "CAPABILITIES", "capabilities_for", "check_features", "check_compression"]

# each architecture's row (engine.architectures), by name
CAPABILITIES: dict[str, Capabilities] = {name: row.capabilities for name, row in ARCHITECTURES.items()}


def capabilities_for(architecture: str) -> Capabilities:
    try:
        return CAPABILITIES[architecture]
    except KeyError:
        raise UnsupportedFeatureError(f"no capability row for architecture {architecture!r}") from None


def check_features(architecture: str, device: str, *, spec: str = "none", compress: str = "off",
                   attention: str = "dense", cuda_graphs: bool = False, head_dim: int = 64,
                   compression=None, drafter_architecture: str | None = None,
                   self_drafting: bool = False) -> list[str]:
    """Raise UnsupportedFeatureError for a combination this build cannot run; return notes for
    options that are accepted but have no effect here. `compression` (CompressionOptions) adds
    the PFlash checks of `check_compression`."""
    caps = capabilities_for(architecture)
    notes = []
    if compression is not None:
        notes += check_compression(architecture, device, compression, drafter_architecture=drafter_architecture,
                                   self_drafting=self_drafting)
        compress = compression.mode
    device_type = device.split(":")[0]
    where = f"architecture {architecture} on {device_type}"
    if device_type not in caps.devices:
        raise UnsupportedFeatureError(f"device {device_type!r} is not supported for {architecture}")
    if spec != "none" and spec not in caps.speculation:
        raise UnsupportedFeatureError(f"--spec {spec} is not supported for {where}" + _because(caps, f"--spec {spec}"))
    if compress != "off" and not caps.compression:
        raise UnsupportedFeatureError(f"--compress {compress} is not supported for {where}" + _because(caps, "--compress"))
    if attention not in caps.attention:
        raise UnsupportedFeatureError(f"--attention {attention} is not supported for {where}"
                                      + _because(caps, f"--attention {attention}"))
    if attention == "sparse" and head_dim & (head_dim - 1):
        raise UnsupportedFeatureError(
            f"--attention sparse needs a power-of-two head_dim; {architecture} has {head_dim}; use dense")
    if cuda_graphs and device_type != "cuda":
        notes.append("CUDA graphs requested but the device is the CPU: steps run eagerly")
    if attention == "sparse" and device_type != "cuda":
        notes.append("sparse attention on the CPU runs the PyTorch reference (slow; for tests)")
    return notes


def _because(caps: Capabilities, option: str) -> str:
    """': why', where the row says why `option` does not apply."""
    why = caps.reason(option)
    return f": {why}" if why else ""


COMPRESS_MODES = ("off", "auto", "always")


def check_compression(architecture: str, device: str, options, *, drafter_architecture: str | None = None,
                      self_drafting: bool = False, drafter_path: str | None = None) -> list[str]:
    """PFlash options (engine.types.CompressionOptions) for a target: refuse what cannot run,
    note what would do nothing. `drafter_architecture` is the drafter checkpoint's, when known;
    `self_drafting`: no drafter path was given and the target's own checkpoint will draft."""
    mode, ratio, threshold = options.mode, options.keep_ratio, options.threshold_tokens
    device_type = device.split(":")[0]
    if mode not in COMPRESS_MODES:
        raise UnsupportedFeatureError(f"--compress {mode!r} is not a mode; use one of {', '.join(COMPRESS_MODES)}")
    notes = []
    if mode == "off":
        if options.drafter_path:
            notes.append("--compress-drafter has no effect with --compress off")
        return notes
    if not capabilities_for(architecture).compression:
        raise UnsupportedFeatureError(f"--compress {mode} is not supported for architecture {architecture} "
                                      f"on {device_type}" + _because(capabilities_for(architecture), "--compress"))
    if not 0.0 < ratio <= 1.0:
        raise UnsupportedFeatureError(f"--keep-ratio {ratio} is outside (0, 1]; use e.g. 0.1 to keep a tenth")
    if threshold < 0:
        raise UnsupportedFeatureError(f"--compress-threshold {threshold} is negative; use a token count >= 0")
    if drafter_architecture is not None:
        drafter_caps = CAPABILITIES.get(drafter_architecture)
        if drafter_caps is None or not (drafter_caps.compression and drafter_caps.pflash_drafter):
            supported = ", ".join(a for a, c in CAPABILITIES.items() if c.compression and c.pflash_drafter)
            why = drafter_caps.reason("pflash drafter") if drafter_caps is not None else ""
            raise UnsupportedFeatureError(f"--compress-drafter {drafter_path or ''}: architecture "
                                          f"{drafter_architecture!r} cannot be a PFlash drafter (supported: {supported})"
                                          + (f"; {why}" if why else ""))
    elif self_drafting and not capabilities_for(architecture).pflash_drafter:
        raise UnsupportedFeatureError(f"--compress {mode} without --compress-drafter would have {architecture} draft "
                                      f"for itself: {capabilities_for(architecture).reason('pflash drafter')}")
    if ratio == 1.0:
        notes.append("--keep-ratio 1.0 keeps every chunk: PFlash scores the prompt but compresses nothing")
    if self_drafting:
        notes.append("no --compress-drafter given: the target's own checkpoint drafts (slower than a small drafter)")
    return notes
