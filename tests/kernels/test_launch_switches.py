"""The launch knobs the decode kernels read from the host: kernels.options (the kill switches from
the environment, read once; the what-ifs, such as where each kernel signals its dependents,
kernels._pdl) and which attention tile a head-group size gets (DecodeTile)."""
from __future__ import annotations

import pytest

from batchd.kernels import options as kernel_options_module
from batchd.kernels._backend import early_reads_enabled, pdl_trigger_point
from batchd.kernels.options import (PDL_TRIGGER_DEFAULT, KernelOptions, current_options, environment_defaults,
                                    kernel_options, parse_option, set_kernel_options)
from tests.kernels.conftest import needs_triton


def test_trigger_point_defaults_to_after_the_wait():
    assert PDL_TRIGGER_DEFAULT == 1
    assert all(KernelOptions().trigger_point(k) == 1 for k in ("linear", "reduce", "split", "merge"))
    assert all(pdl_trigger_point(k) == 1 for k in ("linear", "reduce", "split", "merge"))


def test_trigger_point_for_every_kernel_or_by_name():
    with kernel_options(pdl_trigger=2):
        assert pdl_trigger_point("linear") == 2 and pdl_trigger_point("merge") == 2
    with kernel_options(pdl_trigger={"linear": 2, "split": 0}):
        assert (pdl_trigger_point("linear"), pdl_trigger_point("split"), pdl_trigger_point("merge")) == (2, 0, 1)
    assert pdl_trigger_point("linear") == 1                          # the block's options end with it
    assert parse_option("pdl_trigger", "0,merge:2") == ("pdl_trigger", {"linear": 0, "reduce": 0, "split": 0,
                                                                        "merge": 2})   # all, then one named
    assert parse_option("BATCHD_PDL_TRIGGER", "linear:2") == ("pdl_trigger", {"linear": 2})   # the old spelling
    assert KernelOptions(pdl_trigger={"linear": 1}) == KernelOptions()   # hashable, compared by value
    assert hash(KernelOptions(pdl_trigger=1)) == hash(KernelOptions())


def test_options_out_of_range_are_refused():
    with pytest.raises(ValueError, match="points 0, 1 or 2"):
        KernelOptions(pdl_trigger={"linear": 3})
    with pytest.raises(ValueError, match="points 0, 1 or 2"):
        KernelOptions(pdl_trigger={"lm_head": 1})
    with pytest.raises(ValueError, match="early_reads"):
        KernelOptions(early_reads="yes")
    with pytest.raises(ValueError, match="a percent"):
        KernelOptions(stream_carveout=120)
    with pytest.raises(ValueError, match="0, 1 or 2"):
        KernelOptions(stream_phase_marks=3)
    with pytest.raises(ValueError, match="attention_cluster"):
        KernelOptions(attention_cluster=12)
    with pytest.raises(ValueError, match="attention_key_block"):
        KernelOptions(attention_key_block=48)
    with pytest.raises(ValueError, match="unknown kernel option"):
        parse_option("no_such_option", "1")
    with pytest.raises(ValueError, match="cannot read"):
        parse_option("fused_mlp", "yes")


def test_kill_switches_come_from_the_environment_once(monkeypatch):
    """BATCHD_PDL, BATCHD_FUSED_MLP and BATCHD_ATTENTION_CLUSTER set the defaults, read at the first
    use and cached: a later change of the environment changes nothing; what-ifs never come from it."""
    monkeypatch.setattr(kernel_options_module, "_current", None)
    environment_defaults.cache_clear()
    try:
        monkeypatch.setenv("BATCHD_PDL", "0")
        monkeypatch.setenv("BATCHD_FUSED_MLP", "1")
        monkeypatch.setenv("BATCHD_ATTENTION_CLUSTER", "8")
        monkeypatch.setenv("BATCHD_PDL_TRIGGER", "2")        # no longer a switch: ignored
        assert current_options() == KernelOptions(pdl=False, fused_mlp=True, attention_cluster=8)
        monkeypatch.setenv("BATCHD_PDL", "1")
        assert current_options().pdl is False                # read once
        with kernel_options(pdl=True) as options:
            assert current_options() is options and options.fused_mlp is True
        assert current_options().pdl is False
        environment_defaults.cache_clear()
        monkeypatch.setenv("BATCHD_FUSED_MLP", "yes")
        with pytest.raises(ValueError, match="BATCHD_FUSED_MLP"):
            current_options()
    finally:
        environment_defaults.cache_clear()


def test_set_kernel_options_holds_until_reset():
    try:
        set_kernel_options(KernelOptions(early_reads="off"))
        assert not early_reads_enabled()
        with kernel_options(early_reads="force", pdl_trigger=0):
            assert early_reads_enabled()
        assert current_options().early_reads == "off"
    finally:
        set_kernel_options(None)
    assert current_options() == environment_defaults()


def test_stream_what_ifs_become_defines():
    assert KernelOptions().stream_defines() == ()          # off: consumers trigger, no marks
    assert KernelOptions(stream_producer_trigger=True).stream_defines() == ("-DPRODUCER_TRIGGER",)
    assert KernelOptions(stream_producer_trigger=True, stream_phase_marks=2).stream_defines() == (
        "-DPRODUCER_TRIGGER", "-DPHASE_MARKS", "-DPHASE_DETAIL")   # 2: the attention kernel's compute
    assert parse_option("stream_carveout", "100") == ("stream_carveout", 100)


@needs_triton
def test_fitted_tiles_only_where_measured():
    from batchd.kernels.decode_attention.triton_kernel import DecodeTile, decode_tile

    assert decode_tile(4) == DecodeTile()            # Llama-3-8B's G keeps the tuned default
    assert decode_tile(3) == DecodeTile()            # SmolLM2
    for group in (6, 7):                             # Qwen2.5-1.5B; Qwen2.5-0.5B and 7B
        tile = decode_tile(group)
        assert tile.fit_rows and tile.num_warps == 4  # fixed warps: what keeps decode == verify bits


def test_early_reads_stop_with_a_trigger_before_the_wait():
    """Settled inputs are only settled while no kernel launches its dependents before its own wait
    (kernels._pdl): a trigger 0 anywhere, the stream producer's trigger, or early_reads="off" turns
    the early reads off; "force" keeps them."""
    assert early_reads_enabled()
    assert KernelOptions(pdl_trigger=2).early_reads_enabled()
    assert not KernelOptions(pdl_trigger={"merge": 0}).early_reads_enabled()
    assert not KernelOptions(stream_producer_trigger=True).early_reads_enabled()   # its producer, at its start
    assert not KernelOptions(early_reads="off").early_reads_enabled()
    assert KernelOptions(early_reads="force", pdl_trigger={"merge": 0}).early_reads_enabled()
    assert parse_option("BATCHD_EARLY_READS", "0") == ("early_reads", "off")
