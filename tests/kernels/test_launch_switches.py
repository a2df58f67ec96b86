"""The launch knobs the decode kernels read from the host: where each signals its dependents
(BATCHD_PDL_TRIGGER, kernels._pdl) and which attention tile a head-group size gets (DecodeTile)."""
from __future__ import annotations

import pytest

from batchd.kernels._backend import PDL_TRIGGER_DEFAULT, pdl_trigger_point
from tests.kernels.conftest import needs_triton


def test_trigger_point_defaults_to_after_the_wait(monkeypatch):
    monkeypatch.delenv("BATCHD_PDL_TRIGGER", raising=False)
    assert PDL_TRIGGER_DEFAULT == 1
    assert all(pdl_trigger_point(k) == 1 for k in ("linear", "reduce", "split", "merge"))


def test_trigger_point_for_every_kernel_or_by_name(monkeypatch):
    monkeypatch.setenv("BATCHD_PDL_TRIGGER", "2")
    assert pdl_trigger_point("linear") == 2 and pdl_trigger_point("merge") == 2
    monkeypatch.setenv("BATCHD_PDL_TRIGGER", "linear:2,split:0")
    assert (pdl_trigger_point("linear"), pdl_trigger_point("split"), pdl_trigger_point("merge")) == (2, 0, 1)
    monkeypatch.setenv("BATCHD_PDL_TRIGGER", "0,merge:2")          # a default for all, then one named
    assert (pdl_trigger_point("reduce"), pdl_trigger_point("merge")) == (0, 2)


def test_trigger_point_out_of_range_is_refused(monkeypatch):
    monkeypatch.setenv("BATCHD_PDL_TRIGGER", "linear:3")
    with pytest.raises(ValueError, match="trigger points are 0, 1 or 2"):
        pdl_trigger_point("linear")


@needs_triton
def test_fitted_tiles_only_where_measured():
    from batchd.kernels.decode_attention.triton_kernel import DecodeTile, decode_tile

    assert decode_tile(4) == DecodeTile()            # Llama-3-8B's G keeps the tuned default
    assert decode_tile(3) == DecodeTile()            # SmolLM2
    for group in (6, 7):                             # Qwen2.5-1.5B; Qwen2.5-0.5B and 7B
        tile = decode_tile(group)
        assert tile.fit_rows and tile.num_warps == 4  # fixed warps: what keeps decode == verify bits


def test_early_reads_stop_with_a_trigger_before_the_wait(monkeypatch):
    """Settled inputs are only settled while no kernel launches its dependents before its own wait
    (kernels._pdl): a trigger 0 anywhere, or BATCHD_EARLY_READS=0, turns the early reads off."""
    from batchd.kernels._backend import early_reads_enabled

    monkeypatch.delenv("BATCHD_PDL_TRIGGER", raising=False)
    monkeypatch.delenv("BATCHD_EARLY_READS", raising=False)
    assert early_reads_enabled()
    monkeypatch.setenv("BATCHD_PDL_TRIGGER", "2")
    assert early_reads_enabled()
    monkeypatch.setenv("BATCHD_PDL_TRIGGER", "merge:0")
    assert not early_reads_enabled()
    monkeypatch.delenv("BATCHD_PDL_TRIGGER")
    monkeypatch.setenv("BATCHD_STREAM_PRODUCER_TRIGGER", "1")   # kernels.stream_linear's producer, at its start
    assert not early_reads_enabled()
    monkeypatch.delenv("BATCHD_STREAM_PRODUCER_TRIGGER")
    monkeypatch.setenv("BATCHD_EARLY_READS", "0")
    assert not early_reads_enabled()
