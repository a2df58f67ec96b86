"""kernels._trace: the recorder's bookkeeping on any machine; on CUDA, that traced kernels write
sane times into their rows and compute the same bits as untraced ones."""
from __future__ import annotations

import pytest
import torch

from batchd.kernels import _trace

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_without_a_recorder_kernels_compile_without_marks():
    dummy = torch.zeros(1)
    assert _trace.trace_args("linear", (3, 4), dummy) == dict(Trace=dummy, trace_row=0, TRACE=False)


def test_recorder_reserves_consecutive_rows_and_refuses_past_its_capacity():
    recorder = _trace.Recorder(torch.device("cpu"), capacity=10)
    assert recorder.reserve("a", 4) == 0
    assert recorder.reserve("b", 6) == 4
    assert [(l.label, l.first_row, l.programs, l.captured) for l in recorder.launches] == [
        ("a", 0, 4, False), ("b", 4, 6, False)]
    with pytest.raises(RuntimeError, match="larger capacity"):
        recorder.reserve("c", 1)


def test_recording_needs_cuda():
    with pytest.raises(ValueError, match="CUDA only"):
        with _trace.recording(torch.device("cpu")):
            pass


@needs_cuda
def test_traced_kernels_write_ordered_times_and_the_same_bits():
    from batchd.kernels.decode_attention import decode_attention
    from batchd.kernels.small_matmul.triton_kernel import SmallLinearConfig, small_linear_triton

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 256, generator=g).to(torch.bfloat16).cuda()
    w = torch.randn(192, 256, generator=g).to(torch.bfloat16).cuda()
    q = torch.randn(1, 8, 1, 64, generator=g).to(torch.bfloat16).cuda()
    k = torch.randn(1, 2, 300, 64, generator=g).to(torch.bfloat16).cuda()
    v = torch.randn(1, 2, 300, 64, generator=g).to(torch.bfloat16).cuda()
    split = SmallLinearConfig(32, 64, 2)

    def calls():
        return (small_linear_triton(x, w, None), small_linear_triton(x, w, None, config=split),
                decode_attention(q, k, v, 300))

    plain = calls()
    with _trace.recording(torch.device("cuda"), capacity=4096) as recorder:
        traced = calls()
        torch.cuda.synchronize()
    for a, b in zip(plain, traced):
        assert torch.equal(a, b)
    labels = [launch.label for launch in recorder.launches]
    assert labels[0] == "linear 192x256" and labels[1] == "linear 192x256 2 splits"
    assert labels[2].startswith("reduce 192") and labels[3].startswith("attention split")
    assert labels[4].startswith("attention merge")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for launch in recorder.launches:
        rows = recorder.rows[launch.first_row:launch.first_row + launch.programs].cpu()
        start, waited, end, sm = rows.unbind(1)
        assert (start > 0).all() and (start <= waited).all() and (waited <= end).all(), launch.label
        assert ((sm >= 0) & (sm < sms)).all()
    assert recorder.rows[sum(l.programs for l in recorder.launches):].eq(0).all()   # nothing past them
