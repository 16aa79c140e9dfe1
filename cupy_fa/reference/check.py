"""The bars a kernel result is held to: the relative error of a whole result, and the per-request,
per-row checker the GPU tests use."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ._host import to_numpy

TOL = {"float16": 3e-3, "bfloat16": 1e-2}


def relative_error(out, ref) -> float:
    """``||out - ref||_F / ||ref||_F`` in float64; ``inf`` if either holds a NaN.

    Matching infinities (e.g. ``lse = -inf`` for a query that sees nothing) count as equal;
    a zero ``ref`` gives 0 when ``out`` is zero too, else ``inf``.
    """
    a = np.asarray(to_numpy(out), np.float64)
    r = np.asarray(to_numpy(ref), np.float64)
    if a.shape != r.shape:
        raise ValueError(f"shape mismatch: {a.shape} vs {r.shape}")
    if np.isnan(a).any() or np.isnan(r).any():
        return math.inf
    with np.errstate(invalid="ignore"):
        d = np.where(a == r, 0.0, a - r)
    if not np.isfinite(d).all():
        return math.inf
    diff = np.linalg.norm(d)
    norm = np.linalg.norm(np.where(np.isfinite(r), r, 0.0))
    if norm == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return float(diff / norm)


# ---- the per-request, per-row checker ---------------------------------------------------
#
# relative_error above is one norm over a whole batch: one long decode request, one row of a
# prefill or one split of a row is a small part of that norm, so a wrong one can hide under the
# bar (tests/test_checker_cpu.py measures how often). check_attention holds every request
# AND every query row to the bar on its own, bounds the largest element error of each, checks
# the LSE of every (row, head), and checks that rows which must not be written (the tail of a
# poisoned buffer past the live rows, the rows of a request refused on the device) were not.

# Largest |out - ref| of a request or a row, over the largest |ref| of it. A correct kernel's
# worst element is its rounding of P (a unit roundoff u of the dtype, relative to the row's
# scale) plus the output's own rounding (u again): 2u, i.e. 7.8e-3 in bf16 and 9.8e-4 in fp16.
MAX_ABS = {"float16": 4e-3, "bfloat16": 2e-2}
# An element's error no larger than the output type's smallest subnormal (fp16 2^-24 = 6.0e-8; bf16
# 2^-133) is that type's own rounding, not the kernel's: a row whose reference lies below the fp16
# normal range (a sink that outweighs its few keys, say: 1e-8 everywhere) can only be written as
# zeros and subnormals, whose relative error no kernel can bring under the bars. Such elements count
# as exact; any error above the floor counts whole (a row of |ref| >= 2e-5 is held to the bars as
# before, since 3e-3 of it is already past the floor).
ABS_FLOOR = {"float16": 2.0 ** -24, "bfloat16": 2.0 ** -133}
# |lse - ref_lse| in natural-log units, per (row, head): the kernels keep the softmax sums and
# every LSE in fp32, so a correct one is off by ~1e-6 times the LSE's size.
LSE_TOL = {"float16": 1e-3, "bfloat16": 1e-3}


@dataclasses.dataclass
class AttentionCheck:
    """What :func:`check_attention` found. Truthy when nothing failed.

    ``failures``: one line per failing request, row, LSE row or written-when-it-must-not row,
    each with its numbers. ``worst``: the largest figure of each kind over the whole result
    (``request_rel``, ``row_rel``, ``max_abs``, ``lse_abs``), with where it was, printed by
    :meth:`summary` for a passing result too, so a log shows the margin left."""

    label: str
    failures: list
    worst: dict
    counts: dict

    def __bool__(self):
        return not self.failures

    @property
    def ok(self):
        return not self.failures

    def failing(self, kind):
        """The failure lines of one kind: request, row, lse, unwritten, nan, written."""
        return [f for f in self.failures if f.startswith(kind + " ")]

    def summary(self):
        parts = []
        for key, text in (("request_rel", "worst request rel"), ("row_rel", "worst row rel"),
                          ("max_abs", "worst max-abs/max|ref|"), ("lse_abs", "worst lse abs")):
            if key in self.worst:
                value, where = self.worst[key]
                parts.append(f"{text} {value:.2e} ({where})")
        counts = ", ".join(f"{v} {k}" for k, v in self.counts.items())
        head = f"{self.label}: " if self.label else ""
        return f"{head}{'ok' if self.ok else f'{len(self.failures)} FAILING'}; {'; '.join(parts)}; checked {counts}"

    def report(self, limit=40):
        lines = [self.summary()] + self.failures[:limit]
        if len(self.failures) > limit:
            lines.append(f"... and {len(self.failures) - limit} more")
        return "\n".join(lines)

    def assert_ok(self):
        if self.failures:
            raise AssertionError(self.report())
        return self


def _poisoned(x, poison):
    """Elementwise: does x still hold the poison value (NaN poison: is NaN)?"""
    if isinstance(poison, float) and math.isnan(poison):
        return np.isnan(x)
    return x == np.asarray(poison, np.float64)


def check_attention(out, ref, dtype, *, q_lens=None, q_indptr=None, lse=None, ref_lse=None, poison=None,
                    refused=(), label="", tol=None, max_abs=None, lse_tol=None) -> AttentionCheck:
    """Compares a kernel's result with this module's float64 reference, request by request and
    query row by query row, and reports every one that fails with its numbers.

    Args:
        out: ``[R, H_q, D]`` the kernel's output buffer as it came back (any float dtype, NumPy,
            CuPy or torch). Its first ``T = sum(q_lens)`` rows are the live rows; rows ``T ..
            R - 1`` (a preallocated buffer's tail) must still hold ``poison``.
        ref: ``[T, H_q, D]`` the reference (:func:`paged_attention`).
        dtype: ``"float16"`` or ``"bfloat16"``: picks the bars (:data:`TOL`, :data:`MAX_ABS`,
            :data:`LSE_TOL`); ``tol`` / ``max_abs`` / ``lse_tol`` override them.
        q_lens / q_indptr: ``[B]`` query tokens per request, or ``[B + 1]`` their offsets (one of
            the two): which rows belong to which request.
        lse, ref_lse: optional ``[R, H_q]`` kernel LSE (its tail poisoned like ``out``'s) and
            ``[T, H_q]`` reference LSE: every (row, head) within ``lse_tol``.
        poison: the value ``out`` (and ``lse``) were filled with before the run. Required when
            ``out`` has a tail or ``refused`` is given. A live element still holding it was
            never written.
        refused: requests whose rows must hold ``poison`` untouched (a row the device refused).

    Checked, each failure one line:
        ``nan``       a live row with NaN / inf elements (or ``unwritten``: still the poison);
        ``request``   a request whose relative error ``||out - ref|| / ||ref||`` over its rows is
                      over ``tol``, or whose ``max|out - ref| / max|ref|`` is over ``max_abs``
                      (an element off by at most :data:`ABS_FLOOR` counting as exact);
        ``row``       the same for one query row (all heads) of a request of several rows;
        ``lse``       a row with some head's ``|lse - ref_lse|`` over ``lse_tol``;
        ``written``   a tail row or a refused request's row that does not hold the poison.

    Returns an :class:`AttentionCheck` (truthy when all passed; ``.assert_ok()`` raises with the
    report).
    """
    tol = TOL[dtype] if tol is None else tol
    max_abs = MAX_ABS[dtype] if max_abs is None else max_abs
    lse_tol = LSE_TOL[dtype] if lse_tol is None else lse_tol
    got = np.asarray(to_numpy(out), np.float64)
    want = np.asarray(to_numpy(ref), np.float64)
    if (q_lens is None) == (q_indptr is None):
        raise ValueError("give exactly one of q_lens and q_indptr")
    if q_indptr is None:
        q_indptr = np.concatenate([[0], np.cumsum(np.asarray(to_numpy(q_lens), np.int64).reshape(-1))])
    indptr = np.asarray(to_numpy(q_indptr), np.int64).reshape(-1)
    total = int(indptr[-1])
    if want.shape[0] != total or got.ndim != want.ndim or got.shape[1:] != want.shape[1:] or got.shape[0] < total:
        raise ValueError(f"out {got.shape} / ref {want.shape} do not fit {total} live rows")
    refused = sorted({int(b) for b in refused})
    if (got.shape[0] > total or refused) and poison is None:
        raise ValueError("out has rows past the live ones (or refused requests): give the poison they were filled with")
    failures, worst, counts = [], {}, {"requests": 0, "rows": 0}

    def where_of(row):
        b = int(np.searchsorted(indptr, row, side="right") - 1)
        return b, row - int(indptr[b])

    def check_untouched(name, arr, rows, why):
        if arr is None or not len(rows):
            return
        kept = _poisoned(arr[rows], poison).reshape(len(rows), int(np.prod(arr.shape[1:], dtype=np.int64)))
        for r, ok in zip(rows, kept.all(axis=1)):
            if not ok:
                vals = arr[r].reshape(-1)
                bad = ~_poisoned(vals, poison)
                failures.append(f"written {name} row {r} ({why}): {int(bad.sum())} of {bad.size} elements changed "
                                f"(e.g. {vals[bad][0]:.4g}; poison {poison})")

    got_lse = None if lse is None else np.asarray(to_numpy(lse), np.float64)
    want_lse = None if ref_lse is None else np.asarray(to_numpy(ref_lse), np.float64)
    if (got_lse is None) != (want_lse is None):
        raise ValueError("give both lse and ref_lse, or neither")
    if got_lse is not None and (got_lse.shape[0] != got.shape[0] or want_lse.shape != want.shape[:2]):
        raise ValueError(f"lse {got_lse.shape} / ref_lse {want_lse.shape} do not fit out {got.shape}")

    tail = np.arange(total, got.shape[0])
    check_untouched("out", got, tail, "past the live rows")
    check_untouched("lse", got_lse, tail, "past the live rows")
    live_row = np.ones(total, bool)
    for b in refused:
        rows = np.arange(indptr[b], indptr[b + 1])
        live_row[rows] = False
        check_untouched("out", got, rows, f"request {b}, refused")
        check_untouched("lse", got_lse, rows, f"request {b}, refused")

    live = got[:total]
    width = int(np.prod(want.shape[1:], dtype=np.int64))  # elements of one row (reshape(0, -1) is ambiguous)
    flat = live.reshape(total, width)
    finite = np.isfinite(flat).all(axis=1)
    for r in np.flatnonzero(live_row & ~finite):
        b, t = where_of(r)
        stale = int(_poisoned(flat[r], poison).sum()) if poison is not None else 0
        kind = "unwritten" if stale == flat.shape[1] else "nan"
        failures.append(f"{kind} row {r} (request {b} token {t}): {int((~np.isfinite(flat[r])).sum())} of "
                        f"{flat.shape[1]} elements not finite")
    if poison is not None and not (isinstance(poison, float) and math.isnan(poison)):
        stale_rows = live_row & finite & _poisoned(flat, poison).any(axis=1)
        for r in np.flatnonzero(stale_rows):
            b, t = where_of(r)
            failures.append(f"unwritten row {r} (request {b} token {t}): {int(_poisoned(flat[r], poison).sum())} "
                            f"elements still hold the poison {poison}")

    d = np.where(np.isfinite(live), live - want, np.inf)
    d = np.where(np.isnan(d), np.inf, d)
    d = np.where(np.abs(d) <= ABS_FLOOR.get(dtype, 0.0), 0.0, d)  # the output type's own rounding (ABS_FLOOR)
    # per row: sum of squares and largest element of the error and of the reference; the rows of
    # refused requests count as nothing (their poison was checked above)
    live_col = live_row[:, None]
    d2 = np.where(live_col, (d * d).reshape(total, width), 0.0).sum(axis=1)
    r2 = np.where(live_col, (want * want).reshape(total, width), 0.0).sum(axis=1)
    dmax = np.where(live_row, np.abs(d).reshape(total, width).max(axis=1, initial=0.0), 0.0)
    rmax = np.where(live_row, np.abs(want).reshape(total, width).max(axis=1, initial=0.0), 0.0)

    def figures(diff2, norm2, dm, rm):  # ||d|| / ||ref|| and max|d| / max|ref| (0 / 0 = 0, x / 0 = inf)
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = np.where(norm2 > 0, np.sqrt(diff2 / np.where(norm2 > 0, norm2, 1)), np.where(diff2 > 0, np.inf, 0.0))
            mab = np.where(rm > 0, dm / np.where(rm > 0, rm, 1), np.where(dm > 0, np.inf, 0.0))
        return rel, mab

    row_rel, row_abs = figures(d2, r2, dmax, rmax)
    sizes = np.diff(indptr)
    checked = np.flatnonzero((sizes > 0) & ~np.isin(np.arange(len(sizes)), refused))
    if checked.size:
        starts = indptr[checked]
        # per request: sums and maxima over its rows (segments from each checked request's first row
        # to the next one's; a refused request's rows in between count as nothing)
        req_rel, req_abs = figures(np.add.reduceat(d2, starts), np.add.reduceat(r2, starts),
                                   np.maximum.reduceat(dmax, starts), np.maximum.reduceat(rmax, starts))
        counts["requests"] = int(checked.size)
        i = int(np.argmax(req_rel)); worst["request_rel"] = (float(req_rel[i]), f"request {checked[i]}")
        i = int(np.argmax(req_abs)); worst["max_abs"] = (float(req_abs[i]), f"request {checked[i]}")
        for b, rel, mab in zip(checked, req_rel, req_abs):
            if not (rel <= tol and mab <= max_abs):
                lo, hi = int(indptr[b]), int(indptr[b + 1])
                failures.append(f"request {b} (rows {lo}..{hi - 1}, q_len {hi - lo}): rel {rel:.3e} (bar {tol:g}), "
                                f"max-abs/max|ref| {mab:.3e} (bar {max_abs:g})")
        # rows of requests of several rows (a one-row request was just checked as a request)
        multi = np.zeros(total, bool)
        for b in checked[sizes[checked] > 1]:
            multi[indptr[b]:indptr[b + 1]] = True
        if multi.any():
            counts["rows"] = int(multi.sum())
            rows = np.flatnonzero(multi)
            r = int(rows[np.argmax(row_rel[rows])])
            b, t = where_of(r)
            worst["row_rel"] = (float(row_rel[r]), f"row {r} = request {b} token {t}")
            for r in rows[~((row_rel[rows] <= tol) & (row_abs[rows] <= max_abs))]:
                b, t = where_of(int(r))
                failures.append(f"row {r} (request {b} token {t}): rel {row_rel[r]:.3e} (bar {tol:g}), "
                                f"max-abs/max|ref| {row_abs[r]:.3e} (bar {max_abs:g})")

    if got_lse is not None and live_row.any():
        mine, theirs = got_lse[:total], want_lse
        with np.errstate(invalid="ignore"):
            err = np.where(mine == theirs, 0.0, np.abs(mine - theirs))  # matching infinities agree
        err = np.where(np.isnan(err), np.inf, err)
        per_row = np.where(live_row, err.max(axis=1, initial=0.0), 0.0)
        counts["lse rows"] = int(live_row.sum())
        r = int(np.argmax(per_row))
        b, t = where_of(r)
        worst["lse_abs"] = (float(per_row[r]), f"row {r} = request {b} token {t}")
        for r in np.flatnonzero(live_row & ~(per_row <= lse_tol)):
            b, t = where_of(int(r))
            h = int(np.argmax(err[r]))
            failures.append(f"lse row {r} (request {b} token {t}): max |lse - ref| {per_row[r]:.3e} at head {h} "
                            f"(got {mine[r, h]:.6g}, ref {theirs[r, h]:.6g}; bar {lse_tol:g})")
    if refused:
        counts["refused requests"] = len(refused)
    if len(tail):
        counts["tail rows"] = len(tail)
    return AttentionCheck(label, failures, worst, counts)
