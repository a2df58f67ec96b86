"""Where one decode layer's time goes, program by program: the start, wait return and end of every
small_linear, split-K reduce, attention split and merge program, and of every kernels.stream_linear
CTA with `N,K=stream` variants (kernels._trace, %globaltimer) in
one replayed greedy decode step (one CUDA graph), and the multiprocessors they ran on.

    python bench/timeline.py --shape qwen2.5-1.5b [--context 512] [--csv programs.csv] [--variants "table;..."]

For each launch of a layer, the median over the middle layers of (µs, from the END of the last
program of the launch before it, i.e. from when that launch was done):

  first start, last start   when its first and last programs began (negative: launched early,
                            under programmatic dependent launch)
  first wait                when its first griddepcontrol.wait returned
  median end, last end      its programs' median and last END; "last end" is what the launch adds
                            to the step (profile_decode's increment, from inside the kernels)
  run after wait            a program's median END - WAITED (its own work once it may read)
  SMs                       how many multiprocessors its programs ran on

--variants takes bench/step_sweep.py's variants (table entries, switches), one table each.
With the variant option stream_phase_marks=1, a table of the stream kernels' phases after
their wait follows (phase_table).
--csv writes every program of the step (launch index, label, layer, program, sm, start, waited,
end in ns from the step's first start) for a closer look without device time.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchd.engine.presets import preset  # noqa: E402
from batchd.engine.runtime import Engine, EngineConfig, build_model  # noqa: E402
from batchd.engine.types import GenerationRequest, SamplingParams  # noqa: E402
from batchd.kernels import _trace  # noqa: E402
from batchd.kernels.options import current_options  # noqa: E402

START, WAITED, END, SM = (int(column.value) for column in (_trace.START, _trace.WAITED, _trace.END, _trace.SM))


def last_replay(recorder: _trace.Recorder) -> list[tuple[_trace.Launch, torch.Tensor]]:
    """The launches of the graph replayed last, in launch order, each with its rows [programs, 4]
    (ns from the step's first start): the captured runs of launches, the one that ended last."""
    rows = recorder.rows.cpu()
    of = lambda launch: rows[launch.first_row:launch.first_row + launch.programs]  # noqa: E731
    runs, run = [], []
    for launch in recorder.launches:
        if launch.captured:
            run.append(launch)
        elif run:
            runs.append(run)
            run = []
    if run:
        runs.append(run)
    written = [r for r in runs if all(of(launch)[:, START].ne(0).all() for launch in r)]
    if not written:
        raise SystemExit("no captured launch wrote its rows: was a graph replayed with the recorder open?")
    run = max(written, key=lambda r: int(of(r[-1])[:, END].max()))
    t0 = min(int(of(launch)[:, START].min()) for launch in run)
    out = []
    for launch in run:
        block = of(launch).clone()
        block[:, :3] -= t0
        out.append((launch, block))
    return out


def layer_period(labels: list[str], num_layers: int) -> tuple[int, int]:
    """(first index, launches per layer) of the run of labels that repeats num_layers times."""
    for first in range(len(labels)):
        for period in range(1, (len(labels) - first) // num_layers + 1):
            if all(labels[first + i] == labels[first + i + period] for i in range((num_layers - 1) * period)):
                return first, period
    raise SystemExit("no launch pattern repeats once per layer")


def layer_table(step, num_layers: int) -> list[dict]:
    labels = [launch.label for launch, _ in step]
    first, period = layer_period(labels, num_layers)
    us = lambda ns: ns / 1e3  # noqa: E731
    table = []
    for position in range(period):
        samples = []
        for layer in range(1, num_layers - 1):            # the middle layers: neighbours on both sides
            i = first + layer * period + position
            before = float(step[i - 1][1][:, END].max())
            t = step[i][1].double()
            start, waited, end = t[:, START], t[:, WAITED], t[:, END]
            samples.append(dict(
                first_start=us(float(start.min()) - before), last_start=us(float(start.max()) - before),
                first_wait=us(float(waited.min()) - before), median_end=us(float(end.median()) - before),
                last_end=us(float(end.max()) - before), run_after_wait=us(float((end - waited).median())),
                sms=len(set(t[:, SM].long().tolist()))))
        row = {"launch": labels[first + position], "programs": step[first + position][0].programs}
        for key in samples[0]:
            row[key] = round(statistics.median(s[key] for s in samples), 2)
        table.append(row)
    return table


# the phases a kernel marks with stream_phase_marks=1 (kernels.options), by its launches' label prefix
PHASES = {
    "stream": ("x_staged", "weights_there", "dot_done", "epilogue_issued"),             # kernels.stream_linear
    "attention cluster": ("kv_staged", "partials_pushed", "partials_landed", "merged"),  # kernels/decode_attention
}
DETAIL_PHASES = {"attention cluster": ("cluster_joined", "block0_softmax", "last_softmax", "pushed")}   # =2


def phase_table(step, num_layers: int, kernel: str, names: tuple[str, ...] | None = None) -> list[dict]:
    """With stream_phase_marks=1 the SM slot of a CTA of `kernel` (a PHASES key) holds thread 0's
    phases after its wait (KernelOptions.stream_phase_marks: 16 bits of ns each,
    65535 for none): per launch of a layer, the median over the middle layers' CTAs, in us after
    the wait, with the run after it."""
    labels = [launch.label for launch, _ in step]
    first, period = layer_period(labels, num_layers)
    names = names or PHASES[kernel]
    table = []
    for position in range(period):
        if not labels[first + position].startswith(kernel):
            continue
        samples = []
        for layer in range(1, num_layers - 1):
            for start, waited, end, packed in step[first + layer * period + position][1].tolist():
                phases = [(int(packed) >> (16 * i)) & 0xFFFF for i in range(len(names))]
                if 65535 not in phases:
                    samples.append([*phases, end - waited])
        if samples:
            columns = list(zip(*samples))
            row = {"launch": labels[first + position], "ctas": len(samples)}
            row.update({name: round(statistics.median(c) / 1e3, 2) for name, c in zip((*names, "end"), columns)})
            table.append(row)
    return table


def write_csv(step, path: str, num_layers: int) -> None:
    labels = [launch.label for launch, _ in step]
    first, period = layer_period(labels, num_layers)
    with open(path, "w") as f:
        f.write("launch,label,layer,program,sm,start_ns,waited_ns,end_ns\n")
        for i, (launch, block) in enumerate(step):
            layer = (i - first) // period if first <= i < first + num_layers * period else -1
            for p, (start, waited, end, sm) in enumerate(block.tolist()):
                f.write(f"{i},{launch.label},{layer},{p},{sm},{start},{waited},{end}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-1.5b")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--csv", help="write every program of the step to this CSV (VARIANT in the name: its index)")
    parser.add_argument("--variants", default="table", help="bench/step_sweep.py variants separated by ';'")
    args = parser.parse_args()
    from bench.step_sweep import apply_variant
    from batchd.kernels.small_matmul import triton_kernel

    config = preset(args.shape)
    model = build_model(config, "cuda", torch.bfloat16)
    tuned = dict(triton_kernel.TUNED)
    for index, spec in enumerate(args.variants.split(";")):
        apply_variant(spec, tuned)
        print(f"\nvariant {spec!r}")
        trace_step(model, config, args.context, args.csv.replace("VARIANT", str(index)) if args.csv else None)
    apply_variant("table", tuned)


def trace_step(model, config, context: int, csv_path: str | None) -> None:
    from bench.common import print_table

    engine = Engine(model, None, EngineConfig(max_context=context + 64), eos_ids=set())
    prompt = list(range(context))
    request = GenerationRequest(sampling=SamplingParams(max_new_tokens=17, ignore_eos=True))
    with _trace.recording("cuda") as recorder:
        engine.generate_ids(prompt, request)          # captures the decode graph with the marks in it
        recorder.rows.zero_()
        out = engine.generate_ids(prompt, request)    # replays it: the rows hold the last step's times
        torch.cuda.synchronize()
    step = last_replay(recorder)
    span = max(float(b[:, END].max()) for _, b in step) / 1e3
    print(f"context {context}: {out.decode_tokens_per_s:.0f} tok/s with the marks; "
          f"{len(step)} traced launches over {span:.1f} us of the last step")
    if csv_path:
        write_csv(step, csv_path, config.num_layers)
        print(f"wrote {csv_path}")
    table = layer_table(step, config.num_layers)
    print_table(table)
    print(f"layer: {sum(r['last_end'] for r in table):.1f} us (sum of the last ends)")
    marks = current_options().stream_phase_marks
    if marks in (1, 2):
        print("thread 0 of each CTA, us after its wait (the sms column above counts packed phases, not SMs):")
        for kernel, names in PHASES.items():
            print_table(phase_table(step, config.num_layers, kernel, DETAIL_PHASES.get(kernel, names) if marks == 2 else names))


if __name__ == "__main__":
    main()
