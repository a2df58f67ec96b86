"""The kernels' launch options: three kill switches, whose defaults the environment sets (read once),
and the what-ifs that bench tools try (never read from the environment).

    from batchd.kernels.options import current_options, kernel_options

    with kernel_options(pdl_trigger={"linear": 2}, early_reads="off"):
        ...   # kernels launched (and CUDA graphs captured) in here use these options

Kill switches (documented; the environment gives the defaults, read at the first kernel launch):

    pdl                BATCHD_PDL=0: no programmatic dependent launch (kernels._pdl)
    fused_mlp          BATCHD_FUSED_MLP=1 wherever it fits, 0 never; unset (None): the shapes where it
                       measured faster than the small_matmul chain (kernels.fused_mlp.fused_mlp_wanted)
    attention_cluster  BATCHD_ATTENTION_CLUSTER=0 off, 8 or 16 CTAs a KV head; unset (None): 16 where
                       the clusters take at most half the GPU, else 8 (cluster_kernel.cluster_size)

What-ifs (bench/step_sweep.py and bench/timeline.py set them per variant; each changes no value
unless its line says so):

    pdl_trigger              where the decode kernels (TRIGGER_KERNELS) signal their dependents
                             (kernels._pdl: 0 before their wait, 1 after it, 2 before the epilogue):
                             one point for all, or a mapping of kernel -> point (others keep 1)
    early_reads              "auto": settled inputs read before the wait while every trigger is 1
                             or 2; "off": never; "force": whatever the triggers (measurements only)
    stream_producer_trigger  the stream kernels' producer also signals its dependents at its start
    stream_carveout          the stream kernels' preferred shared share of L1/shared, a percent
                             (None: the driver's choice)
    stream_phase_marks       1: traced stream CTAs mark thread 0's phases after its wait
                             (bench/timeline.py); 2: the cluster attention kernel marks its compute
    attention_key_block      the cluster attention kernel's keys a softmax step (32 or 64; moves a
                             lane's bits, the same way for a decode step and its verify lane)

The current options are process-wide (every thread, every engine): set them before an engine
captures its graphs, which keep what was current at capture.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

TRIGGER_KERNELS = ("linear", "reduce", "split", "merge")
PDL_TRIGGER_DEFAULT = 1
EARLY_READS = ("auto", "off", "force")
CLUSTER_SIZES = (8, 16)     # 8 is the portable maximum; 16 needs the non-portable opt-in (sm_90 has it)
KEY_BLOCKS = (32, 64)
DEFAULT_KEY_BLOCK = 32
KILL_SWITCHES = {"pdl": "BATCHD_PDL", "fused_mlp": "BATCHD_FUSED_MLP", "attention_cluster": "BATCHD_ATTENTION_CLUSTER"}


@dataclass(frozen=True)
class KernelOptions:
    # kill switches
    pdl: bool = True
    fused_mlp: bool | None = None
    attention_cluster: int | None = None
    # what-ifs
    pdl_trigger: int | Mapping[str, int] | tuple[tuple[str, int], ...] = PDL_TRIGGER_DEFAULT
    early_reads: str = "auto"
    stream_producer_trigger: bool = False
    stream_carveout: int | None = None
    stream_phase_marks: int = 0
    attention_key_block: int = DEFAULT_KEY_BLOCK

    def __post_init__(self):
        # pdl_trigger is kept as ((kernel, point), ...) over TRIGGER_KERNELS: hashable and comparable
        given = self.pdl_trigger
        if isinstance(given, int):
            points = dict.fromkeys(TRIGGER_KERNELS, given)
        else:
            points = dict.fromkeys(TRIGGER_KERNELS, PDL_TRIGGER_DEFAULT) | dict(given)
        if set(points) != set(TRIGGER_KERNELS) or any(p not in (0, 1, 2) for p in points.values()):
            raise ValueError(f"pdl_trigger: points 0, 1 or 2 for kernels of {TRIGGER_KERNELS}, got {given!r}")
        object.__setattr__(self, "pdl_trigger", tuple((k, points[k]) for k in TRIGGER_KERNELS))
        if self.early_reads not in EARLY_READS:
            raise ValueError(f"early_reads is one of {EARLY_READS}, got {self.early_reads!r}")
        if self.attention_cluster not in (None, 0, *CLUSTER_SIZES):
            raise ValueError(f"attention_cluster is None (auto), 0 (off) or one of {CLUSTER_SIZES}, "
                             f"got {self.attention_cluster!r}")
        if self.attention_key_block not in KEY_BLOCKS:
            raise ValueError(f"attention_key_block is one of {KEY_BLOCKS}, got {self.attention_key_block!r}")
        if self.stream_carveout is not None and not 0 <= self.stream_carveout <= 100:
            raise ValueError(f"stream_carveout is a percent (0-100) or None, got {self.stream_carveout!r}")
        if self.stream_phase_marks not in (0, 1, 2):
            raise ValueError(f"stream_phase_marks is 0, 1 or 2, got {self.stream_phase_marks!r}")

    def trigger_point(self, kernel: str) -> int:
        """Where decode kernel `kernel` (one of TRIGGER_KERNELS) signals its dependents."""
        return dict(self.pdl_trigger)[kernel]

    def early_reads_enabled(self) -> bool:
        """Whether a kernel whose caller passed `settled=True` reads those inputs before its wait
        (kernels._pdl, "Settled inputs"): safe only while every kernel triggers its dependents at or
        after its own wait; a trigger before it (0, or the stream producer's) runs launches two deep,
        and "two launches back" is no longer finished. "force" keeps the reads whatever the triggers
        (safe only where the launch after an early trigger reads nothing early from the one before)."""
        if self.early_reads != "auto":
            return self.early_reads == "force"
        if self.stream_producer_trigger:
            return False
        return all(point >= 1 for _, point in self.pdl_trigger)

    def stream_defines(self) -> tuple[str, ...]:
        """The -D options these what-ifs give the CUDA stream and cluster kernels."""
        phases = {1: ("-DPHASE_MARKS",), 2: ("-DPHASE_MARKS", "-DPHASE_DETAIL")}.get(self.stream_phase_marks, ())
        return (("-DPRODUCER_TRIGGER",) if self.stream_producer_trigger else ()) + phases


def parse_option(name: str, text: str) -> tuple[str, object]:
    """(field, value) from a textual setting, as bench variants and the environment spell them:
    `pdl_trigger=linear:2,split:0` (or `2` for all, or `0,merge:2`: a point for all, then named
    ones), `early_reads=0|1|force` (also off|auto), `fused_mlp=0|1`, `attention_cluster=0|8|16`,
    `stream_carveout=PERCENT`, ...; a name may also be spelt as its old variable, BATCHD_PDL_TRIGGER."""
    field = name.removeprefix("BATCHD_").lower()
    fields = {f.name: f for f in dataclasses.fields(KernelOptions)}
    if field not in fields:
        raise ValueError(f"unknown kernel option {name!r}: one of {tuple(fields)}")
    text = text.strip()
    try:
        if field == "pdl_trigger":
            points: dict[str, int] = {}
            for item in filter(None, text.split(",")):
                kernel, sep, point = item.partition(":")
                if sep:
                    points[kernel.strip()] = int(point)
                else:
                    points = dict.fromkeys(TRIGGER_KERNELS, int(kernel))
            return field, points
        if field == "early_reads":
            return field, {"1": "auto", "0": "off"}.get(text, text)
        if field in ("pdl", "stream_producer_trigger"):
            if text not in ("0", "1"):
                raise ValueError
            return field, text == "1"
        if field == "fused_mlp":
            if text not in ("", "0", "1"):
                raise ValueError
            return field, None if text == "" else text == "1"
        if field in ("attention_cluster", "stream_carveout"):
            return field, None if text == "" else int(text)
        return field, int(text)
    except ValueError:
        raise ValueError(f"kernel option {name}: cannot read {text!r}") from None


@functools.cache
def environment_defaults() -> KernelOptions:
    """KernelOptions() with the kill switches the environment sets (BATCHD_PDL, BATCHD_FUSED_MLP,
    BATCHD_ATTENTION_CLUSTER), read once per process."""
    values = {}
    for field, variable in KILL_SWITCHES.items():
        text = os.environ.get(variable)
        if text is None:
            continue
        if field == "pdl":
            values["pdl"] = text != "0"          # any value but 0 leaves it on
        else:
            values.update([parse_option(variable, text)])
    return KernelOptions(**values)


_current: KernelOptions | None = None


def current_options() -> KernelOptions:
    """The options the kernels launch with now."""
    return _current if _current is not None else environment_defaults()


def set_kernel_options(options: KernelOptions | None) -> None:
    """Make `options` current for the whole process; None: back to environment_defaults()."""
    global _current
    _current = options


@contextmanager
def kernel_options(**changes) -> Iterator[KernelOptions]:
    """The current options with `changes` (KernelOptions fields) inside the block, the previous
    ones after it."""
    previous = _current
    options = dataclasses.replace(current_options(), **changes)
    set_kernel_options(options)
    try:
        yield options
    finally:
        set_kernel_options(previous)


__all__ = ["KernelOptions", "current_options", "kernel_options", "set_kernel_options", "environment_defaults",
           "parse_option", "TRIGGER_KERNELS", "PDL_TRIGGER_DEFAULT", "CLUSTER_SIZES", "KEY_BLOCKS",
           "DEFAULT_KEY_BLOCK"]
