"""Interleaved A/B of the folding CTAs' in-CTA merge (cupy_fa.schedule.MERGE_IN_CTA, an experiment: the
CTA that finishes a row block's last group folds the groups' states, no merge_kernel launch) on the
bench's long-context decode cells, whose rows have several groups of 8 splits: `run`'s host time (as
python -m bench.host measures it) and its GPU time (a CUDA graph of 10 runs, bench/timing.py), with the
two points' outputs held equal bit for bit on random inputs.

    PYTHONPATH=. python3 lab/ab_merge_in_cta.py [--cells decode_b16_l32768,decode_b1_l131072] [--rounds 3]
"""

import argparse
import json
import sys

import numpy as np


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cells", default="decode_b16_l32768,decode_b1_l131072")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    import cupy
    import ml_dtypes

    import cupy_fa
    from cupy_fa import schedule

    from bench import timing, workloads as W
    from bench.host import zero_inputs

    results = {}
    for name in args.cells.split(","):
        w = next(x for x in W.WORKLOADS if x.name == name)
        inp = zero_inputs(w, 16)
        s = inp.sets[0]
        rng = np.random.default_rng(1)
        for arr in (s.q, s.cache.k, s.cache.v):  # random 16-bit values, written as their bits
            host = rng.standard_normal(arr.shape, np.float32)
            bits = host.astype(ml_dtypes.bfloat16 if w.dtype == "bfloat16" else np.float16).view(np.uint16)
            arr.view(cupy.uint16)[...] = cupy.asarray(bits)
        host, gpu, outs = {False: [], True: []}, {False: [], True: []}, {}
        for r in range(args.rounds):
            for in_cta in ((False, True) if r % 2 == 0 else (True, False)):
                schedule.MERGE_IN_CTA = in_cta
                attn = cupy_fa.BatchAttention(W.H_Q, W.H_KV, w.head_dim, w.dtype)
                attn.plan(inp.q_lens, inp.kv_lens, inp.page_table, causal=w.causal)
                assert attn.planned.schedule.merge_in_cta == in_cta, attn.planned.schedule
                run = lambda: attn.run(s.q, s.cache, out=s.out)
                s.out.view(cupy.uint16).fill(0x7FFF)  # NaN: a row the point does not write cannot pass as equal
                run()
                cupy.cuda.Device().synchronize()
                outs.setdefault(in_cta, cupy.asnumpy(s.out).view(np.uint16))
                host[in_cta].append(timing.host_us(run, cupy.cuda.Device().synchronize, args.repeats))
                gpu[in_cta].append(timing.cupy_graph([run] * 10, warmup=5, reps=20).time_us)
        schedule.MERGE_IN_CTA = False
        same = np.array_equal(outs[False], outs[True])
        med = lambda xs: float(np.median(xs))
        line = (f"ab {name:24s} run host: merge_kernel {med(host[False]):6.1f} us, in-CTA {med(host[True]):6.1f} us | "
                f"GPU: {med(gpu[False]):8.1f} us, {med(gpu[True]):8.1f} us (x{med(gpu[False]) / med(gpu[True]):.3f}) | "
                f"out bits {'equal' if same else 'DIFFER'}")
        print(line, flush=True)
        results[name] = dict(host_us=host, gpu_us=gpu, bits_equal=bool(same))
        del inp, s
        cupy.get_default_memory_pool().free_all_blocks()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: {kk: ({str(a): b for a, b in vv.items()} if isinstance(vv, dict) else vv)
                           for kk, vv in v.items()} for k, v in results.items()}, f, indent=1)
    return 0 if all(r["bits_equal"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
