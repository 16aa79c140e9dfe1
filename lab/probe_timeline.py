"""Where a step loses time against its ceiling (diagnosis only, GPU): decode-like steps on the
mma.sync tile, and (2026-12-07) prefill cells on the sm90 tile, any bench workload or ab_hopper's
lab cells (its dtype, fp8 cache, head dims and soft-cap; not sinks).

For each workload (bench/workloads.py, page 16):
* the timeline of one launch, from the attention kernel's stamps (and on the sm90 tile its
  producer's: time waiting for its own copies, for free stages, and filling stages) (a build with the knob
  CUPY_FA_TRACE on, kernels/shared/trace.cuh): when each CTA starts, gets its first K/V tile and ends, how
  long its stamping thread (thread 0 on the mma.sync tile, the first consumer thread on the sm90
  tile) waited for K / V and spent in split epilogues, which SM it ran on;
  summarised as the launch's span, the start-up latency of the first and later waves, the gap
  an SM slot sits idle between one CTA's end and the next one's first tile, and the spread of
  the last CTAs' ends (the tail);
* the graph-replay time with random q and with q = 0 (the same instructions; only the data the
  tensor cores see differ), and the SM clock and power nvidia-smi reports while it replays.

Usage on the device: python3 lab/probe_timeline.py [workload ...] > probe.txt
"""

import dataclasses
import os
import subprocess
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cupy  # noqa: E402

import cupy_fa  # noqa: E402
from cupy_fa import _build, knobs  # noqa: E402
from cupy_fa._timing import per_launch_us_for  # noqa: E402
from bench import inputs, workloads  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_hopper import add_lab_workloads  # noqa: E402

add_lab_workloads(workloads)  # the lab cells (fp16 queries over 16-bit and fp8 caches)

DEFAULT = ["decode_b64_l4096", "verify_q4_b64_l4096", "verify_q8_b64_l4096", "decode_b1_l131072",
           "decode_b16_l32768"]
LAUNCHES = 20  # per graph, over rotating input sets


def attention_variants():
    """The attention kernel variants compiled so far, both families (their trace buffers hold the
    stamps): the mma.sync tile's, and the sm90 prefill tile's (stamped from its first consumer
    thread: its first tile is its first S, its epilogue the last P V's wait and the rows' stores)."""
    return _build.compiled_kernels("mma_sync/attention.cu") + _build.compiled_kernels("sm90/prefill.cu")


def resident_per_sm(start, done, sm):
    """The most CTAs one SM held at once."""
    most = 0
    for s in np.unique(sm):
        on = sm == s
        events = sorted([(t, 1) for t in start[on]] + [(t, -1) for t in done[on]], key=lambda e: (e[0], e[1]))
        now = 0
        for _, step in events:
            now += step
            most = max(most, now)
    return most


def timeline(stamps):
    """Summary (us) of one launch's CTA stamps (rows: start, first tile, done, epilogue ns,
    loop-top wait ns, the sm90 producer's ns waiting for its copies, for free stages and filling,
    SM: _build.trace_buffer)."""
    start, first, done, epilogue_ns, wait_ns, copy_ns, empty_ns, fill_ns, sm = (
        stamps[:, i].astype(np.int64) for i in range(9))
    t0 = start.min()
    start, first, done = (start - t0) / 1e3, (first - t0) / 1e3, (done - t0) / 1e3
    first = np.where(first >= start, first, done)  # a CTA without a K/V tile
    span = done.max()
    slots_per_sm = resident_per_sm(start, done, sm)
    lines = [f"  {len(start)} CTAs on {len(np.unique(sm))} SMs, at most {slots_per_sm} at once per SM; "
             f"span (first start to last end) {span:.1f} us"]
    later = start > 2.0  # CTAs of later waves (the first wave starts within ~1 us)
    for name, sel in (("first wave", ~later), ("later waves", later)):
        if sel.any():
            lat = first[sel] - start[sel]
            lines.append(f"  {name}: {sel.sum()} CTAs, start -> first tile p50 {np.median(lat):.2f} "
                         f"p90 {np.percentile(lat, 90):.2f} us, duration p50 "
                         f"{np.median(done[sel] - start[sel]):.1f} us, min {np.min(done[sel] - start[sel]):.1f} "
                         f"max {np.max(done[sel] - start[sel]):.1f}")
            lines.append(f"    per CTA (stamping thread, p50): {np.median(wait_ns[sel]) / 1e3:.1f} us at the loop-top wait "
                         f"(K/V not in yet, or the barrier), {np.median(epilogue_ns[sel]) / 1e3:.1f} us in split "
                         f"epilogues, {np.median(done[sel] - start[sel] - (wait_ns[sel] + epilogue_ns[sel]) / 1e3):.1f}"
                         f" us the rest (tile math, issuing copies, start-up)")
            if (copy_ns[sel] + empty_ns[sel] + fill_ns[sel]).any():  # the sm90 producer's sums (thread 0)
                dur = np.median(done[sel] - start[sel])
                c, e, f = (np.median(x[sel]) / 1e3 for x in (copy_ns, empty_ns, fill_ns))
                lines.append(f"    producer (thread 0, p50): {c:.1f} us waiting for its copies, {e:.1f} us for free "
                             f"stages, {f:.1f} us filling stages (fp8: widening, fence, arrival; 16-bit: issuing "
                             f"copies), {dur - c - e - f:.1f} us the rest of the CTA")
    # per SM: each later CTA takes the slot of the earliest-ending CTA before it on that SM
    idle, gaps = 0.0, []
    for s in np.unique(sm):
        on = np.flatnonzero(sm == s)
        on = on[np.argsort(start[on])]
        ends = sorted(done[on[:slots_per_sm]])
        idle += sum(first[i] for i in on[:slots_per_sm])  # before each first-wave CTA's first tile
        for i in on[slots_per_sm:]:
            freed = ends.pop(0)
            gaps.append(first[i] - freed)
            ends = sorted(ends + [done[i]])
        idle += sum(span - e for e in ends)  # after the SM's last CTAs end
        idle += (slots_per_sm - min(slots_per_sm, len(on))) * span
    n_sms = 132
    slot_time = n_sms * slots_per_sm * span
    if gaps:
        g = np.array(gaps)
        lines.append(f"  slot handover (a CTA's end to the next CTA's first tile): p50 {np.median(g):.2f} "
                     f"p90 {np.percentile(g, 90):.2f} us over {len(g)} handovers, {g.sum():.0f} slot-us")
        idle += g.sum()
    lines.append(f"  slots without K/V in flight: {100 * idle / slot_time:.1f}% of {n_sms} x {slots_per_sm} "
                 f"slots x span (start-up, handovers, tail)")
    ends = np.sort(done)
    lines.append(f"  tail: CTA ends p10 {np.percentile(ends, 10):.1f}, p50 {np.percentile(ends, 50):.1f}, "
                 f"p90 {np.percentile(ends, 90):.1f}, last {ends[-1]:.1f} us; "
                 f"the last 10% of CTAs end over {ends[-1] - np.percentile(ends, 90):.1f} us")
    return lines


class Clocks:
    """nvidia-smi sampling SM clock and power every 50 ms, read by a background thread."""

    def __init__(self):
        self.proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw", "--format=csv,noheader,nounits",
             "-lms", "50"], stdout=subprocess.PIPE, text=True)
        self.samples = []  # (wall time, sm MHz, mem MHz, W)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            try:
                self.samples.append((time.time(), float(parts[0]), float(parts[1]), float(parts[2])))
            except (ValueError, IndexError):
                pass

    def between(self, t0, t1):
        got = [s for s in self.samples if t0 <= s[0] <= t1]
        if not got:
            return "no samples"
        a = np.array(got)
        return (f"SM clock median {np.median(a[:, 1]):.0f} MHz (min {a[:, 1].min():.0f}), mem "
                f"{np.median(a[:, 2]):.0f} MHz, power median {np.median(a[:, 3]):.0f} W (max {a[:, 3].max():.0f}), "
                f"{len(a)} samples")


def replay_for(launches, seconds, clocks):
    """Graph replays for about `seconds` (timed in slices), with the clocks sampled."""
    t0 = time.time()
    per = per_launch_us_for(launches, seconds)
    return per, t0, time.time()


def main(names):
    knobs.use(dataclasses.replace(knobs.knobs(), trace=True))  # the stamps compiled in (kernels/shared/trace.cuh)
    clocks = Clocks()
    for name in names:
        (w,) = workloads.select([name])
        n_sets = workloads.num_sets(w.min_bytes(), 60 << 20, LAUNCHES)
        inp = inputs.make_inputs(w, 16, n_sets, seed=int(time.time()) % 1000)
        attn = cupy_fa.BatchAttention(workloads.H_Q, workloads.H_KV, w.head_dim, dtype=w.dtype,
                                      kv_dtype=w.kv_dtype or None, head_dim_vo=w.head_dim_vo or None)
        attn.plan(inp.q_lens, inp.kv_lens, inp.page_table, causal=w.causal, logits_soft_cap=w.soft_cap or None)
        sets = inp.sets
        run = [lambda i=i: attn.run(sets[i % n_sets].q, sets[i % n_sets].cache, out=sets[i % n_sets].out)
               for i in range(LAUNCHES)]
        for f in run:
            f()
        cupy.cuda.Device().synchronize()
        run[0]()
        cupy.cuda.Device().synchronize()
        for v in attention_variants():  # (the sm90 tile sums its waits into the buffer: zeroed before the launch read)
            _build.trace_buffer(v).fill(0)
        cupy.cuda.Device().synchronize()
        run[1]()
        cupy.cuda.Device().synchronize()
        print(f"== {name} (page 16, {n_sets} input sets)")
        for v in attention_variants():
            st = cupy.asnumpy(_build.trace_buffer(v))
            real = st[(st[:, 2] > st[:, 0]) & (st[:, 0] > 0)]
            if len(real) == 0:
                continue
            print(f"  variant {v.expression} ({v.threads} threads, {v.smem_bytes} B smem)")
            for line in timeline(real):
                print(line)
        t_rand, a0, a1 = replay_for(run, 2.0, clocks)
        for s in sets:
            s.q.fill(0)
        t_zero, b0, b1 = replay_for(run, 2.0, clocks)
        print(f"  graph replay per launch: random q {t_rand:.1f} us, q = 0 {t_zero:.1f} us "
              f"({100 * (t_rand / t_zero - 1):+.1f}%), {w.kv_bytes() / t_rand / 1e6:.2f} TB/s, "
              f"{w.flops() / t_rand / 1e6:.1f} TFLOP/s random")
        print(f"  random q: {clocks.between(a0, a1)}")
        print(f"  q = 0:    {clocks.between(b0, b1)}")
        del inp, sets, run, attn
        cupy.get_default_memory_pool().free_all_blocks()
        sys.stdout.flush()
    clocks.proc.terminate()


if __name__ == "__main__":
    main(sys.argv[1:] or DEFAULT)
