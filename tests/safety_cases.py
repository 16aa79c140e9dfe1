"""Helpers of the safety tests (bounds, properties, concurrency, the error table):
a step's inputs on the device, and its check against the float64 reference request by request."""

import numpy as np

from cases import TOL, np_dtype, paged_case


def device_step(rng, dtype, heads, head_dim, page_size, q_lens, kv_lens):
    """A step on the device: a shuffled, interleaved paged cache (NaN in every slot no request
    may read) and fresh queries. Returns a dict: q_lens, kv_lens, table, k, v (host), cache, q
    (device), q_host."""
    import cupy

    q_lens, kv_lens = np.asarray(q_lens), np.asarray(kv_lens)
    table, k, v, cache, q_host = paged_case(rng, dtype, heads, head_dim, page_size, kv_lens, int(q_lens.sum()))
    return dict(q_lens=q_lens, kv_lens=kv_lens, table=table, k=k, v=v, cache=cache, q_host=q_host,
                q=cupy.asarray(q_host))


def reference_of(step, custom_mask=None, causal=True):
    from cupy_fa import reference

    return reference.paged_attention(step["q_host"], step["k"], step["v"], step["q_lens"], step["kv_lens"],
                                     step["table"], causal=causal, custom_mask=custom_mask)


def assert_matches(out, ref, dtype, q_lens, label=""):
    """Every live request within the dtype's bar of the reference (relative error over its rows,
    no NaN): ``cupy_fa.reference.check_attention`` where the library has it, else per request here."""
    from cupy_fa import reference

    check = getattr(reference, "check_attention", None)
    if check is not None:
        check(out, ref, dtype, q_lens=q_lens, label=label).assert_ok()
        return
    got = np.asarray(reference.to_numpy(out), np.float64)
    assert not np.isnan(got[:len(ref)]).any(), f"{label}: NaN in a live row"
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    for b in range(len(q_lens)):
        if q_lens[b] == 0:
            continue
        err = reference.relative_error(got[cu[b]:cu[b + 1]], ref[cu[b]:cu[b + 1]])
        assert err < TOL[dtype], f"{label}: request {b} (q_len {q_lens[b]}) relative error {err:.3g}"


def bits(x):
    """The raw bits of a device or host array as a host uint8 array (NaN-safe equality)."""
    from cupy_fa import reference

    a = np.ascontiguousarray(reference.to_numpy(x))
    return a.view(np.uint8).copy()


__all__ = ["assert_matches", "bits", "device_step", "np_dtype", "reference_of"]
