"""`plan`'s host time with a host page table mirrored (copied into the pinned-less mirror beside
the lengths, one driver copy) or sent straight from the caller's array (a second driver copy), by
`cupy_fa._staging.MIRRORED_TABLE_BYTES`, interleaved, on a GPU machine. Written 2026-12-06
(issue 41: decode B=16 L=32768's 128 KiB table planned in 41-42 us against the bar of 40).

    PYTHONPATH=. python3 lab/host_table_copy_ab.py [--rounds 3]
"""

import argparse
import sys

CELLS = ("decode_b16_l32768", "decode_b64_l4096", "decode_b1_l131072", "verify_q4_b64_l4096")
LIMITS = (128 << 10, 16 << 10, 4 << 10)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    import cupy

    import cupy_fa
    from bench import host, timing, workloads as W
    from cupy_fa import _staging

    sync = cupy.cuda.Device().synchronize
    print(f"{'cell':24s} {'table KiB':>9s} " + " ".join(f"{'<=' + str(x >> 10) + 'K':>9s}" for x in LIMITS))
    for name in CELLS:
        w = W.BY_NAME[name]
        inp = host.zero_inputs(w, 16)
        attn = cupy_fa.BatchAttention(W.H_Q, W.H_KV, w.head_dim, w.dtype)
        plan = lambda: attn.plan(inp.q_lens, inp.kv_lens, inp.page_table)
        best = {x: float("inf") for x in LIMITS}
        for _ in range(args.rounds):
            for limit in LIMITS:
                _staging.MIRRORED_TABLE_BYTES = limit
                plan()
                best[limit] = min(best[limit], timing.host_us(plan, sync, 150))
        print(f"{name:24s} {inp.page_table.nbytes / 1024:9.0f} " + " ".join(f"{best[x]:9.1f}" for x in LIMITS),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
