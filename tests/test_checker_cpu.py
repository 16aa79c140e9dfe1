"""The GPU tests' instrument, checked on the CPU: cupy_fa.reference.check_attention.

Two parts. Unit tests feed it small hand-made results, one fault each. The mutation test
builds batches with the suite's own generators (tests/cases.py), takes the float64 reference
with the kernels' rounding of P modelled (``paged_attention(p_dtype=...)``) as a correct
kernel's result, injects one known fault at a time and asserts the checker reports it, at
the request or row where it was put, and nothing else; beside it, the old whole-batch
norm-wise check (``relative_error`` < TOL, plus the LSE's max abs error < 1e-2 where the
test read the LSE), whose misses it counts and prints.

Measured with ``CUPY_FA_MUTATION_BATCHES=25`` on 2026-12-01 at branch issue-16 (25 batches per
dtype, heads 8 / 2, D 64, page 16, the random grid's work budget, each fault moving its request
or row by at least 3x the bar; seeds 1781140585 fp16, 4179070590 bf16), batches in which the old
check passed each fault, fp16 / bf16, output only (how the mode, graph and invariance tests
checked) and with its LSE check (how test_attention_gpu checked):

    sign of a long decode request flipped   0 / 19 of 25    with LSE  0 / 19
    last KV split of a decode row dropped  20 / 25          with LSE  1 /  0
    a row one key short                    16 / 17          with LSE 14 /  5
    a padded row (past the live ones)      25 / 25          with LSE 25 / 25 (never read)

The new checker reported all 200 faults, each at its request or row only, and raised no false
alarm on the 50 correct results.
"""

import math
import os
import re

import numpy as np
import pytest

from cases import POISON, fill_cache, new_rng, np_dtype, paged_layout, random_lengths
from cupy_fa import schedule
from cupy_fa.reference import ABS_FLOOR, LSE_TOL, MAX_ABS, TOL, check_attention, paged_attention, relative_error

# ---- unit tests -----------------------------------------------------------------------


def small_case(rng, q_lens=(1, 3, 0, 2), heads=4, d=8):
    q_lens = np.array(q_lens)
    total = int(q_lens.sum())
    ref = rng.standard_normal((total, heads, d))
    lse = rng.standard_normal((total, heads)) + 3
    return q_lens, ref, lse


def test_exact_result_passes_and_reports_its_worst(capsys):
    rng, _ = new_rng()
    q_lens, ref, lse = small_case(rng)
    out = ref * (1 + 1e-4 * rng.standard_normal(ref.shape))
    check = check_attention(out, ref, "bfloat16", q_lens=q_lens, lse=lse + 1e-5, ref_lse=lse)
    assert check and check.ok and not check.failures
    assert check.counts["requests"] == 3 and check.counts["rows"] == 5  # the request of q_len 0 has no rows
    assert set(check.worst) == {"request_rel", "row_rel", "max_abs", "lse_abs"}
    assert check.worst["lse_abs"][0] == pytest.approx(1e-5)
    assert "ok;" in check.summary()
    check.assert_ok()
    # q_indptr gives the same layout
    indptr = np.concatenate([[0], np.cumsum(q_lens)])
    assert check_attention(out, ref, "bfloat16", q_indptr=indptr).counts == \
        check_attention(out, ref, "bfloat16", q_lens=q_lens).counts


def test_one_wrong_row_among_many_is_reported_with_its_numbers():
    rng, _ = new_rng()
    q_lens, ref, _ = small_case(rng, q_lens=(200, 1, 1))
    out = ref.copy()
    out[57] *= 1.015  # 1.5% off in one row of 200: 0.1% of the request and of the batch
    assert relative_error(out, ref) < TOL["bfloat16"]  # what the old check saw
    check = check_attention(out, ref, "bfloat16", q_lens=q_lens)
    assert not check
    (line,) = check.failures  # the request as a whole is within both bars
    assert line.startswith("row 57 (request 0 token 57): rel 1.500e-02")
    with pytest.raises(AssertionError, match="row 57"):
        check.assert_ok()


def test_a_row_below_the_output_types_range_is_held_to_its_rounding():
    """A row whose reference is ~1e-8 (a large sink over one key: seen on the GPU at fp16) can only be
    written as fp16 zeros and subnormals: counted exact within ABS_FLOOR, failed past it, and a row of
    ordinary size written as zeros still fails."""
    rng, _ = new_rng()
    q_lens, ref, _ = small_case(rng, q_lens=(3,), heads=4, d=8)
    ref[0] *= 1e-8
    out = ref.astype(np.float16).astype(np.float64)  # row 0: all zeros and subnormals
    assert relative_error(out[:1], ref[:1]) > 0.1  # what a relative bar alone would say
    assert check_attention(out, ref, "float16", q_lens=q_lens)
    out[0, 0, 0] = ref[0, 0, 0] + 3 * ABS_FLOOR["float16"]  # an error past the type's rounding
    assert [f.split(":")[0] for f in check_attention(out, ref, "float16", q_lens=q_lens).failures] == [
        "row 0 (request 0 token 0)"]  # (the request as a whole is within the bars)
    out = ref.astype(np.float16).astype(np.float64)
    out[1] = 0.0  # an ordinary row left at zero
    assert [f.split(":")[0] for f in check_attention(out, ref, "float16", q_lens=q_lens).failures][-1] == \
        "row 1 (request 0 token 1)"


def test_one_element_off_fails_the_max_abs_bound():
    rng, _ = new_rng()
    q_lens, ref, _ = small_case(rng, q_lens=(1,), heads=32, d=128)
    out = ref.copy()
    i = np.unravel_index(np.argmax(np.abs(ref)), ref.shape)
    out[i] *= 0.9  # 10% of the largest element: 0.4% of the row's norm, under the bf16 bar
    check = check_attention(out, ref, "bfloat16", q_lens=q_lens)
    assert check.worst["request_rel"][0] < TOL["bfloat16"]
    assert check.worst["max_abs"][0] == pytest.approx(0.1)
    assert [f.split(":")[0] for f in check.failures] == ["request 0 (rows 0..0, q_len 1)"]


def test_lse_per_row_and_matching_infinities():
    rng, _ = new_rng()
    q_lens, ref, lse = small_case(rng)
    lse[2, 1] = -np.inf  # a (row, head) that sees nothing: -inf on both sides agrees
    got = lse.copy()
    got[4, 3] += 2e-3
    check = check_attention(ref, ref, "float16", q_lens=q_lens, lse=got, ref_lse=lse)
    (line,) = check.failures
    assert line.startswith("lse row 4 (request 3 token 0): max |lse - ref| 2.000e-03 at head 3")
    got[4, 3] = lse[4, 3]
    got[2, 1] = 0.0
    assert check_attention(ref, ref, "float16", q_lens=q_lens, lse=got, ref_lse=lse).failing("lse")


def test_unwritten_nan_and_written_rows():
    rng, _ = new_rng()
    q_lens, ref, lse = small_case(rng)  # 6 live rows
    out = np.full((9,) + ref.shape[1:], POISON)
    out[:6] = ref
    lse_buf = np.full((9, ref.shape[1]), POISON)
    lse_buf[:6] = lse
    kwargs = dict(q_lens=q_lens, ref_lse=lse, poison=POISON)
    assert check_attention(out, ref, "float16", lse=lse_buf, **kwargs)
    bad = out.copy()
    bad[2, 1, 3] = POISON  # one element never written
    bad[5, 0, 0] = np.nan
    bad[7] = ref[0]  # a row past the live ones written
    bad_lse = lse_buf.copy()
    bad_lse[8, 2] = 1.0
    check = check_attention(bad, ref, "float16", lse=bad_lse, **kwargs)
    assert [line.split(":")[0] for line in check.failing("unwritten")] == ["unwritten row 2 (request 1 token 1)"]
    assert [line.split(":")[0] for line in check.failing("nan")] == ["nan row 5 (request 3 token 1)"]
    assert [line.split(" (")[0] for line in check.failing("written")] == ["written out row 7", "written lse row 8"]
    # a NaN poison: a live row left NaN is unwritten, a NaN written into the tail goes unseen (why POISON is finite)
    nan_buf = np.where(out == POISON, np.nan, out)
    nan_buf[0] = np.nan
    check = check_attention(nan_buf, ref, "float16", q_lens=q_lens, poison=math.nan)
    assert check.failing("unwritten")[0].startswith("unwritten row 0 (request 0 token 0)")


def test_no_live_rows_only_the_tail():
    """An IDLE step or a bucket of padding: no live row, the whole buffer is tail."""
    out = np.full((4, 2, 8), POISON)
    lse = np.full((4, 2), POISON)
    empty = dict(q_lens=np.zeros(3, int), ref_lse=np.zeros((0, 2)), poison=POISON)
    check = check_attention(out, np.zeros((0, 2, 8)), "float16", lse=lse, **empty)
    assert check and check.counts == {"requests": 0, "rows": 0, "tail rows": 4}
    out[3, 1, 7] = 0.5
    check = check_attention(out, np.zeros((0, 2, 8)), "float16", lse=lse, **empty)
    assert [line.split(" (")[0] for line in check.failures] == ["written out row 3"]


def test_refused_request_must_stay_poisoned():
    rng, _ = new_rng()
    q_lens, ref, lse = small_case(rng)
    out = ref.copy()
    out[1:4] = POISON  # request 1 (rows 1..3) refused: its rows untouched
    check = check_attention(out, ref, "bfloat16", q_lens=q_lens, poison=POISON, refused=[1])
    assert check and check.counts["requests"] == 2 and check.counts["refused requests"] == 1
    out[2] = ref[2]
    check = check_attention(out, ref, "bfloat16", q_lens=q_lens, poison=POISON, refused=[1])
    assert [line.split(" (")[0] for line in check.failures] == ["written out row 2"]


def test_bad_arguments_raise():
    rng, _ = new_rng()
    q_lens, ref, lse = small_case(rng)
    with pytest.raises(ValueError, match="exactly one"):
        check_attention(ref, ref, "float16")
    with pytest.raises(ValueError, match="poison"):
        check_attention(np.concatenate([ref, ref[:1]]), ref, "float16", q_lens=q_lens)
    with pytest.raises(ValueError, match="live rows"):
        check_attention(ref[:-1], ref, "float16", q_lens=q_lens)
    with pytest.raises(ValueError, match="both lse and ref_lse"):
        check_attention(ref, ref, "float16", q_lens=q_lens, lse=lse)


def test_bars_are_the_documented_ones():
    assert TOL == {"float16": 3e-3, "bfloat16": 1e-2}
    assert MAX_ABS["float16"] > TOL["float16"] and MAX_ABS["bfloat16"] > TOL["bfloat16"]
    assert set(LSE_TOL) == set(TOL)


# ---- mutation test --------------------------------------------------------------------

BATCHES = int(os.environ.get("CUPY_FA_MUTATION_BATCHES", "5"))
HEADS, HEAD_DIM, PAGE = (8, 2), 64, 16
BUDGET = 2_500_000  # test_random_ragged_batch's work budget at 8 query heads
MIN_FAULT = 3.0  # a fault the checker must see moves its row or request by at least this x the bar


def old_checks(out, ref, lse, ref_lse, dtype):
    """What the GPU tests asserted before check_attention: (output only, output and LSE)."""
    live = out[:ref.shape[0]].astype(np.float64)
    out_ok = bool(np.isfinite(live).all()) and relative_error(live, ref) < TOL[dtype]
    lse_ok = float(np.abs(lse[:ref.shape[0]].astype(np.float64) - ref_lse).max()) < 1e-2
    return out_ok, out_ok and lse_ok


def one_row(batch, q_row, kv_len, b):
    """Attention of one query row over keys 0 .. kv_len - 1 of request b (what a kernel that
    got that row's key range wrong computes): (out [H, D], lse [H])."""
    q, k, v, q_lens, kv_lens, table = batch
    out, lse = paged_attention(q_row[None], k, v, [1], [kv_len], table[b:b + 1], return_lse=True)
    return out[0], lse[0]


def fault_size(row_out, ref_row):
    return float(np.linalg.norm(row_out - ref_row) / np.linalg.norm(ref_row))


def make_batch(rng, dtype):
    """The random grid's lengths, plus a long decode request whose last split holds at least one
    KV tile and a short prefill, so every fault below has a target in every batch."""
    S = schedule.split_size()
    q_lens, kv_lens = random_lengths(rng, work_budget=BUDGET)
    long_decode = int(rng.integers(4, 15)) * S + int(rng.integers(64, S + 1))
    short_prefill = int(rng.integers(16, 300))
    q_lens = np.concatenate([q_lens, [1, short_prefill]])
    kv_lens = np.concatenate([kv_lens, [long_decode, short_prefill]])
    order = rng.permutation(len(q_lens))  # the added ones anywhere in the batch
    q_lens, kv_lens = q_lens[order], kv_lens[order]
    table, num_pages = paged_layout(rng, kv_lens, PAGE)
    k, v = fill_cache(rng, (num_pages, PAGE, HEADS[1], HEAD_DIM), np_dtype(dtype), table, kv_lens, PAGE)
    q = rng.standard_normal((int(q_lens.sum()), HEADS[0], HEAD_DIM), dtype=np.float32).astype(np_dtype(dtype))
    return q, k, v, q_lens, kv_lens, table


def inject_faults(rng, batch, ref, ref_lse, dtype):
    """Yields (name, target request, target row or None, fault out rows {row: [H, D]}, fault LSE
    rows {row: [H]}, tail row to write or None). Targets are drawn at random among the batch's
    candidates whose fault moves them by at least MIN_FAULT x the bar in float64."""
    q, k, v, q_lens, kv_lens, table = batch
    S, tol = schedule.split_size(), TOL[dtype]
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    decode = np.flatnonzero((q_lens == 1) & (kv_lens > S))

    # 1. a long decode request's whole output with its sign flipped
    b = int(decode[np.argmax(kv_lens[decode])])
    yield "sign flip", b, None, {cu[b]: -ref[cu[b]]}, {}, None

    # 2. a decode row without its last KV split (as if that split's partial never reached the merge)
    for b in rng.permutation(decode):
        kept = (-(-int(kv_lens[b]) // S) - 1) * S
        out, lse = one_row(batch, q[cu[b]], kept, b)
        if fault_size(out, ref[cu[b]]) >= MIN_FAULT * tol:
            yield "split dropped", int(b), None, {cu[b]: out}, {cu[b]: lse}, None
            break
    else:
        raise AssertionError("no decode row whose last split matters: the batch builder must add one")

    # 3. a row of a request of several rows that misses its own key (its causal window one key short)
    multi = np.flatnonzero(q_lens > 1)
    for _ in range(200):
        b = int(rng.choice(multi))
        i = int(rng.integers(0, q_lens[b]))
        pos = int(kv_lens[b] - q_lens[b] + i)
        if pos == 0:
            continue
        out, lse = one_row(batch, q[cu[b] + i], pos, b)
        if fault_size(out, ref[cu[b] + i]) >= MIN_FAULT * tol:
            yield "shifted by a key", b, int(cu[b] + i), {cu[b] + i: out}, {cu[b] + i: lse}, None
            break
    else:
        raise AssertionError("no row of a multi-row request whose one-key shift matters")

    # 4. a padded row written: the buffer's tail past the live rows gets a live row's values
    r = int(rng.integers(0, cu[-1]))
    yield "padded row written", None, None, {}, {}, (r, int(rng.integers(0, 3)))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_checker_catches_injected_faults(dtype):
    rng, seed = new_rng()
    tail = 3
    passed_old = {}
    faults = 0
    for n in range(BATCHES):
        batch = make_batch(rng, dtype)
        q, k, v, q_lens, kv_lens, table = batch
        ref, ref_lse = paged_attention(*batch, return_lse=True)
        total = ref.shape[0]
        # a correct kernel's result: P rounded to the dtype before P.V, the output rounded to it
        good = paged_attention(*batch, p_dtype=np_dtype(dtype)).astype(np_dtype(dtype))
        out = np.full((total + tail,) + ref.shape[1:], POISON, np_dtype(dtype))
        lse = np.full((total + tail, ref.shape[1]), POISON, np.float32)
        out[:total], lse[:total] = good, ref_lse.astype(np.float32)

        def check(o, l):
            return check_attention(o, ref, dtype, q_lens=q_lens, lse=l, ref_lse=ref_lse, poison=POISON,
                                   label=f"seed {seed} batch {n}")

        clean = check(out, lse)
        assert clean, f"false alarm on a correct result:\n{clean.report()}"
        assert all(old_checks(out, ref, lse, ref_lse, dtype))
        print(clean.summary())
        for name, b, row, rows, lse_rows, written in inject_faults(rng, batch, ref, ref_lse, dtype):
            bad_out, bad_lse = out.copy(), lse.copy()
            for r, value in rows.items():
                bad_out[r] = value
            for r, value in lse_rows.items():
                bad_lse[r] = value
            if written is not None:
                src, t = written
                bad_out[total + t], bad_lse[total + t] = out[src], lse[src]
            result = check(bad_out, bad_lse)
            faults += 1
            assert not result, f"{name} went unreported (request {b}, row {row}):\n{result.report()}"
            # reported where it was put, and nowhere else
            for line in result.failures:
                if written is not None:
                    assert line.startswith(f"written out row {total + t} ") or \
                        line.startswith(f"written lse row {total + t} "), line
                elif row is not None:
                    assert re.match(rf"(lse )?(row {row} \(request {b} token|request {b} \()", line), line
                else:
                    assert re.match(rf"(lse )?(row \d+ \(request {b} token|request {b} \()", line), line
            old = old_checks(bad_out, ref, bad_lse, ref_lse, dtype)
            counts = passed_old.setdefault(name, [0, 0])
            counts[0] += old[0]
            counts[1] += old[1]
            print(f"  {name}: new reports {len(result.failures)} line(s), first: {result.failures[0]}")
    assert faults == 4 * BATCHES
    print(f"seed {seed}, {dtype}, {BATCHES} batches: the old check passed (output only / with LSE): " +
          ", ".join(f"{name} {a}/{BATCHES} / {c}/{BATCHES}" for name, (a, c) in passed_old.items()))
    # the old check never reads past the live rows: it passes every written padded row
    assert passed_old["padded row written"] == [BATCHES, BATCHES]
