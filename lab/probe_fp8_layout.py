"""Diagnosis only: decode L=4096, D 128, bf16 queries, over a bf16 and an fp8 cache holding the
same bytes in four layouts: B=64 H 32/8 page 16 (the bench cell), B=512 H 4/1 page 16 (one KV
head: a CTA reads whole pages contiguously), B=64 H 32/8 page 64 and page 1. Prints microseconds
per step, TB/s of the K/V bytes and the fraction of the read ceiling measured in the same process.
Timing only, no float64 check (the bench's cells have it; this runs on probe copies of the
kernel too, which fail it by construction); it counts NaN outputs (poisoned before each first
run, so an element left unwritten counts).

On the device machine, from a tree's root: ``PYTHONPATH=$PWD python3 lab/probe_fp8_layout.py``
(lab/NOTES.md, "The one-group fold tile for fp8 decode", for the figures of 2026-12-02).
``--kv-len 8192 16384`` times the bench layout (B=64 H 32/8 page 16) at 4096 and at those lengths
instead of the four layouts: the same CTAs with more keys each, which separates a per-launch cost
from a per-byte one."""

import numpy as np

D, L = 128, 4096
LAYOUTS = ((64, 32, 8, 16), (512, 4, 1, 16), (64, 32, 8, 64), (64, 32, 8, 1))  # (B, H_q, H_kv, page size)


def decode_caches(batch, h_q, h_kv, page_size, kv_len, rng):
    """``(table, bf16 cache, fp8 cache, q)`` for decode of ``batch`` requests of ``kv_len`` keys: both
    caches from the same normal(0, 1) values (fp8 quantised on the device, scales 0.125), pages
    shuffled, bf16 queries. (lab/probe_clocks.py builds its decode cells here too.)"""
    import cupy
    import cupy_fa
    from bench.inputs import elem_dtype, fill_normal

    pages_per = -(-kv_len // page_size)
    table = rng.permutation(batch * pages_per).astype(np.int32).reshape(batch, pages_per)
    c16 = cupy_fa.PagedKVCache.allocate(batch * pages_per, page_size, h_kv, D, "bfloat16")
    fill_normal(c16.k)
    fill_normal(c16.v)
    c8 = cupy_fa.PagedKVCache.allocate(batch * pages_per, page_size, h_kv, D, "float8_e4m3fn",
                                       k_scale=0.125, v_scale=0.125)
    slots = cupy.arange(c16.num_slots, dtype=cupy.int64)
    c8.append(c16.k.reshape(-1, h_kv, D), c16.v.reshape(-1, h_kv, D), slots)
    q = fill_normal(cupy.empty((batch, h_q, D), elem_dtype("bfloat16")))
    return table, c16, c8, q


def time_layout(batch, h_q, h_kv, page_size, rng, read_tbps, kv_len=L):
    """One layout: both caches from the same values (decode_caches)."""
    import cupy
    import cupy_fa
    from bench import timing
    from bench.inputs import count_nan, poison

    table, c16, c8, q = decode_caches(batch, h_q, h_kv, page_size, kv_len, rng)
    out = cupy.empty_like(q)
    for name, cache, elem in (("bf16", c16, 2), ("fp8", c8, 1)):
        attn = cupy_fa.BatchAttention(h_q, h_kv, D, "bfloat16", kv_dtype="float8_e4m3fn" if elem == 1 else None)
        attn.plan(np.ones(batch, int), np.full(batch, kv_len), table)
        poison(out)
        attn.run(q, cache, out=out)
        nan = count_nan(out)  # an unwritten element counts
        t = timing.cupy_graph([lambda: attn.run(q, cache, out=out)] * 20, warmup=5, reps=30)
        tbps = batch * kv_len * h_kv * D * elem * 2 / (t.time_us * 1e-6) / 1e12
        tile = attn.planned.schedule.launches[-1].tile
        print(f"B={batch:4d} L={kv_len:5d} H {h_q}/{h_kv} page {page_size:2d} {name}: {t.time_us:7.1f} us "
              f"{tbps:5.2f} TB/s {tbps / read_tbps:6.1%}  NaN {nan}  tile stages={tile.stages} fold={tile.fold_splits} "
              f"spc={tile.splits_per_cta}", flush=True)
    del c16, c8
    cupy.get_default_memory_pool().free_all_blocks()


def main(argv=None):
    import argparse

    import cupy
    from bench import ceilings

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kv-len", type=int, nargs="*", default=None,
                        help="time the bench layout at these KV lengths instead of the four layouts at 4096")
    args = parser.parse_args(argv)
    read_tbps = ceilings.measure_read(4 << 30)["tbps"]
    print(f"read ceiling {read_tbps:.2f} TB/s", flush=True)
    lengths = (L, *args.kv_len) if args.kv_len else ()
    batch, _, h_kv, _ = LAYOUTS[0]
    for kv_len in lengths:  # the streaming read over the fp8 cell's bytes alone: its own per-launch cost
        nbytes = batch * kv_len * h_kv * D * 2
        print(f"streaming read of {nbytes / 1e6:.0f} MB (fp8 K+V at L={kv_len}): "
              f"{ceilings.measure_read(nbytes)['tbps']:.2f} TB/s", flush=True)
    rng = np.random.default_rng(7)
    cupy.random.seed(7)
    if lengths:
        for kv_len in lengths:
            time_layout(*LAYOUTS[0], rng, read_tbps, kv_len=kv_len)
        return
    for layout in LAYOUTS:
        time_layout(*layout, rng, read_tbps)


if __name__ == "__main__":
    main()
