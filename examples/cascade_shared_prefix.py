"""Cascade attention over a shared prefix: the prefix's keys attended once for every request's
queries, each request's own suffix attended on its own, the two merged with
``cupy_fa.merge_states``, and the result checked against the float64 reference of the whole.

The batch: B requests that share a system prompt of P tokens (its K/V in pages of its own, stored
once) and each have a suffix of their own (s_b tokens, in their own pages), of which the last q_b
are this step's queries (q_b = 1: decode; more: an extend chunk). Request b's full attention is
over P + s_b keys with the contract's bottom-right causal mask: query i sees keys 0 .. P + s_b -
q_b + i. Every prefix key sits before every query, so it splits into two states of the same rows
over disjoint keys:

* the prefix part: every query of the batch sees all P prefix keys, no mask. One BatchAttention
  step with ``causal=False`` whose "requests" are the batch's query rows in order, over the
  prefix's page-table row (the contract wants q_len <= kv_len, so the rows are cut into entries of
  at most P; one entry, the prefix read once, when the batch has no more than P query rows);
* the suffix part: request b's q_b queries over its own s_b keys, causal (bottom-right, as the
  contract aligns it: query i sees suffix keys 0 .. s_b - q_b + i);

then ``merge_states(out_prefix, lse_prefix, out_suffix, lse_suffix)`` (natural-log LSEs, as
``run(..., return_lse=True)`` returns them) is the attention over the whole. The prefix need not
end on a page boundary: its last page is partly used and the suffixes start on pages of their own,
which one page table per request could not say.

Run from the repository root on a GPU machine:

    PYTHONPATH=. python examples/cascade_shared_prefix.py
    PYTHONPATH=. python examples/cascade_shared_prefix.py --dtype fp16 --page-size 1 --prefix 3000 --requests 32

It prints the relative error of the merged result (and of its LSE) against the float64 reference
of the whole batch, and exits 1 if it is above the library's bar (fp16 3e-3, bf16 1e-2), 2 on a
machine without a usable GPU.
"""

import argparse
import os
import sys

import numpy as np


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--prefix", type=int, default=1000, help="P, the shared prefix's tokens")
    p.add_argument("--requests", type=int, default=8, help="B, requests sharing it")
    p.add_argument("--max-suffix", type=int, default=300, help="each request's own tokens: 1 .. this")
    p.add_argument("--heads", type=int, nargs=2, default=(32, 8), metavar=("H_Q", "H_KV"))
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seed", type=int, default=None, help="default: fresh (printed)")
    return p.parse_args(argv)


def run(args):
    """The cascade step and its check; returns a dict of the figures (``ok``: within the bar)."""
    import cupy

    import cupy_fa
    from cupy_fa import _arrays, reference

    dtype = {"bf16": "bfloat16", "fp16": "float16"}[args.dtype]
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    h_q, h_kv = args.heads
    d, ps, prefix, batch = args.head_dim, args.page_size, args.prefix, args.requests

    # lengths: each request's own suffix, and this step's queries at its end (decode or a chunk)
    suffix = rng.integers(1, args.max_suffix + 1, batch)
    q_lens = np.where(rng.random(batch) < 0.5, 1, np.maximum(1, (suffix * rng.random(batch)).astype(int)))
    q_lens = np.minimum(q_lens, suffix)
    total_q = int(q_lens.sum())

    # pages: the prefix's, then each suffix's, all shuffled over one cache (NaN in every slot no one owns)
    prefix_pages = -(-prefix // ps)
    suffix_pages = [-(-int(s) // ps) for s in suffix]
    num_pages = prefix_pages + sum(suffix_pages) + 2
    order = rng.permutation(num_pages)
    prefix_table = order[:prefix_pages].astype(np.int32)
    suffix_table = np.zeros((batch, max(suffix_pages)), np.int32)
    at = prefix_pages
    for b, n in enumerate(suffix_pages):
        suffix_table[b, :n] = order[at:at + n]
        at += n
    np_dtype = _arrays.DTYPES[dtype]
    shape = (num_pages, ps, h_kv, d)
    k = rng.standard_normal(shape, dtype=np.float32)
    v = rng.standard_normal(shape, dtype=np.float32)
    owned = np.zeros((num_pages, ps), bool)
    owned.reshape(-1)[(prefix_table[np.arange(prefix) // ps] * ps + np.arange(prefix) % ps)] = True
    for b, s in enumerate(suffix):
        owned.reshape(-1)[suffix_table[b, np.arange(s) // ps] * ps + np.arange(s) % ps] = True
    k[~owned], v[~owned] = np.nan, np.nan
    k, v = k.astype(np_dtype), v.astype(np_dtype)
    cache = cupy_fa.PagedKVCache(cupy.asarray(k), cupy.asarray(v))
    q_host = rng.standard_normal((total_q, h_q, d), dtype=np.float32).astype(np_dtype)
    q = cupy.asarray(q_host)

    # 1. the shared prefix, once for every query row of the batch: no mask
    per_entry = max(1, prefix)
    entries = [min(per_entry, total_q - r) for r in range(0, total_q, per_entry)]
    prefix_attn = cupy_fa.BatchAttention(h_q, h_kv, d, dtype)
    prefix_attn.plan(entries, [prefix] * len(entries), np.tile(prefix_table, (len(entries), 1)), causal=False)
    out_prefix, lse_prefix = prefix_attn.run(q, cache, return_lse=True)

    # 2. each request's own suffix: causal, bottom-right over its own keys
    suffix_attn = cupy_fa.BatchAttention(h_q, h_kv, d, dtype)
    suffix_attn.plan(q_lens, suffix, suffix_table, causal=True)
    out_suffix, lse_suffix = suffix_attn.run(q, cache, return_lse=True)

    # 3. the merge: the attention of every query over prefix + its own suffix
    out, lse = cupy_fa.merge_states(out_prefix, lse_prefix, out_suffix, lse_suffix)
    cupy.cuda.get_current_stream().synchronize()

    # the float64 truth of the whole: request b over its P + s_b keys in a cache of one-token pages
    slots = [np.concatenate([prefix_table[np.arange(prefix) // ps] * ps + np.arange(prefix) % ps,
                             suffix_table[b, np.arange(s) // ps] * ps + np.arange(s) % ps])
             for b, s in enumerate(suffix)]
    full_table = np.zeros((batch, max(len(s) for s in slots)), np.int64)
    for b, s in enumerate(slots):
        full_table[b, :len(s)] = s
    flat = (num_pages * ps, 1, h_kv, d)
    ref, ref_lse = reference.paged_attention(q_host, k.reshape(flat), v.reshape(flat), q_lens, prefix + suffix,
                                             full_table, causal=True, return_lse=True)
    check = reference.check_attention(out.get(), ref, dtype, q_lens=q_lens, lse=lse.get(), ref_lse=ref_lse,
                                      label="cascade")
    rel = reference.relative_error(out.get(), ref)
    lse_err = float(np.max(np.abs(lse.get() - ref_lse))) if total_q else 0.0
    read_once = prefix * h_kv * d * 2 * 2 * len(entries)
    read_each = prefix * h_kv * d * 2 * 2 * batch
    print(f"cascade: {batch} requests (q_len {q_lens.min()}..{q_lens.max()}, own keys {suffix.min()}..{suffix.max()}) "
          f"over a shared prefix of {prefix} keys, {dtype} D={d} heads {h_q}/{h_kv} page size {ps}")
    print(f"prefix K/V read {len(entries)} time(s) ({read_once / 2**20:.2f} MiB) instead of once per request "
          f"({read_each / 2**20:.2f} MiB)")
    print(f"relative error vs float64 reference of the whole: {rel:.3e} (bar {reference.TOL[dtype]:g}); "
          f"max |lse - ref| {lse_err:.2e}")
    print(check.summary())
    return {"ok": bool(check) and rel <= reference.TOL[dtype], "rel": rel, "lse_abs": lse_err, "seed": seed,
            "check": check}


def main(argv=None):
    from cupy_fa import _arrays

    args = parse(argv)
    problem = _arrays.cuda_problem()
    if problem is not None:
        print(f"cascade_shared_prefix.py needs a GPU: {problem}", file=sys.stderr)
        return 2
    result = run(args)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
