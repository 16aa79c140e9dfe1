"""Serving modes -> the contract's ``q_len`` / ``kv_len``, in one documented place.

The contract (DESIGN.md section 2): ``q_len`` = query tokens of this step,
``kv_len`` = valid keys in the cache AFTER this step's K/V were written.
Engines hold other extents, and mixing them up is exactly the bug this library
exists to prevent (sglang's DRAFT_EXTEND_V2 regression: a prefix-only extent
hid the freshly written draft keys). So every conversion takes arguments named
for what they mean, and there is one function per convention:

* :func:`contract_lengths` from the step's own quantities:
  ``prefix_lens`` = P, tokens cached BEFORE this step (never including it),
  ``new_lens`` = tokens this step adds (chunk C, or 1 for decode rows),
  ``num_draft_tokens`` = N, ``accepted_lens`` = A.
* :func:`from_sglang` from sglang's ``forward_batch.seq_lens``, whose meaning
  changes with the mode (prefix only for TARGET_VERIFY, already bumped by N for
  DRAFT_EXTEND_V2).

==================  ===========  ===========  ===========================
mode                q_len        kv_len       sglang ``seq_lens`` holds
==================  ===========  ===========  ===========================
EXTEND              C            P + C        P + C
DECODE              1            P + 1        P + 1
MIXED               per row      P + new      P + new
TARGET_VERIFY       N            P + N        P        (prefix only)
DRAFT_EXTEND (v1)   A            P + A        P + A
DRAFT_EXTEND_V2     N            P + N        P + N    (already bumped)
IDLE                (no rows)    (no rows)    (no rows)
==================  ===========  ===========  ===========================

The functions work on NumPy, CuPy or torch integer arrays alike (only
elementwise arithmetic), so a graph-replayed engine can convert on the device.
Causality: every mode is bottom-right causal; tree TARGET_VERIFY replaces the
causal part among the N drafts with a custom mask (prefix still fully visible).
"""

import enum

import numpy as np


class ForwardMode(enum.Enum):
    EXTEND = "extend"
    DECODE = "decode"
    MIXED = "mixed"
    TARGET_VERIFY = "target_verify"
    DRAFT_EXTEND = "draft_extend"
    DRAFT_EXTEND_V2 = "draft_extend_v2"
    IDLE = "idle"

    @property
    def fixed_q_len(self):
        """True when every live request has the same q_len (1 or N)."""
        return self in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2)


def _like(lengths, value):
    """An array shaped like `lengths` filled with `value`, in its framework."""
    return lengths * 0 + value


def _require(mode, **named):
    missing = [name for name, value in named.items() if value is None]
    if missing:
        raise ValueError(f"{mode.name} needs {', '.join(missing)}")


def _empty():
    return np.zeros(0, np.int32), np.zeros(0, np.int32)


def contract_lengths(mode, *, prefix_lens=None, new_lens=None, num_draft_tokens=None, accepted_lens=None):
    """``(q_lens, kv_lens)`` of a step from what it adds to each request.

    Args:
        mode: a :class:`ForwardMode`.
        prefix_lens: ``[B]`` tokens of each request cached BEFORE this step.
        new_lens: ``[B]`` tokens this step adds (EXTEND chunk, MIXED rows; 1 = a decode row).
        num_draft_tokens: N, for TARGET_VERIFY and DRAFT_EXTEND_V2.
        accepted_lens: ``[B]`` accepted tokens A, for DRAFT_EXTEND (v1).
    """
    mode = ForwardMode(mode)
    if mode is ForwardMode.IDLE:
        return _empty()
    _require(mode, prefix_lens=prefix_lens)
    if mode in (ForwardMode.EXTEND, ForwardMode.MIXED):
        _require(mode, new_lens=new_lens)
        q = new_lens
    elif mode is ForwardMode.DECODE:
        q = _like(prefix_lens, 1)
    elif mode in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2):
        _require(mode, num_draft_tokens=num_draft_tokens)
        q = _like(prefix_lens, int(num_draft_tokens))
    else:  # DRAFT_EXTEND v1
        _require(mode, accepted_lens=accepted_lens)
        q = accepted_lens
    return q, prefix_lens + q


def from_sglang(mode, seq_lens, *, extend_seq_lens=None, num_draft_tokens=None, accept_lens=None):
    """``(q_lens, kv_lens)`` from sglang's ``forward_batch.seq_lens`` and friends.

    ``seq_lens`` means P + C (EXTEND, MIXED), P + 1 (DECODE), P only
    (TARGET_VERIFY), P + A (DRAFT_EXTEND), P + N (DRAFT_EXTEND_V2: sglang bumps it
    by the draft count before building metadata).
    """
    mode = ForwardMode(mode)
    if mode is ForwardMode.IDLE:
        return _empty()
    if mode in (ForwardMode.EXTEND, ForwardMode.MIXED):
        _require(mode, extend_seq_lens=extend_seq_lens)
        return extend_seq_lens, seq_lens
    if mode is ForwardMode.DECODE:
        return _like(seq_lens, 1), seq_lens
    if mode is ForwardMode.TARGET_VERIFY:
        _require(mode, num_draft_tokens=num_draft_tokens)
        return _like(seq_lens, int(num_draft_tokens)), seq_lens + int(num_draft_tokens)
    if mode is ForwardMode.DRAFT_EXTEND:
        _require(mode, accept_lens=accept_lens)
        return accept_lens, seq_lens
    _require(mode, num_draft_tokens=num_draft_tokens)  # DRAFT_EXTEND_V2
    return _like(seq_lens, int(num_draft_tokens)), seq_lens
