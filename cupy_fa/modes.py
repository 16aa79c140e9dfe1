"""Serving modes -> the contract's ``q_len`` / ``kv_len``, in one documented place.

The contract (docs/design.md, "The contract" and "Forward modes"): ``q_len`` = query tokens of this step,
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

The functions take Python ints or lists, NumPy, CuPy or torch integer arrays and give
the lengths back in the caller's kind (lists for lists, an int for an int, a torch tensor
on the caller's device for a torch tensor, ...), so a graph-replayed engine can convert on
the device. Host values (ints, lists, NumPy, CPU torch) are checked first, and a bad one
raises naming the argument and the request; device arrays are not read (that would sync).
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

    @classmethod
    def _missing_(cls, value):
        """A value that names no mode: a ValueError listing the ones there are (member names work too)."""
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        raise ValueError(f"mode must be a cupy_fa.ForwardMode or one of {', '.join(repr(m.value) for m in cls)}, "
                         f"got {value!r}")

    @property
    def fixed_q_len(self):
        """True when every live request has the same q_len (1 or N)."""
        return self in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2)


class _Kind:
    """The caller's kind of array, from the first lengths argument: every other lengths
    argument is brought to it, every result handed back in it."""

    def __init__(self, x):
        import numpy as np

        self.torch = self.cupy = None
        self.listlike = isinstance(x, (list, tuple))
        self.scalar = isinstance(x, (int, np.integer)) and not isinstance(x, bool)
        module = type(x).__module__.split(".")[0]
        if module == "torch":
            self.torch = x
        elif module == "cupy":
            self.cupy = x

    def array(self, name, x):
        """``x`` in the working array kind (NumPy for ints and lists), checked for rank and dtype."""
        import numpy as np

        if isinstance(x, bool) or (isinstance(x, (list, tuple)) and any(isinstance(v, bool) for v in x)):
            raise TypeError(f"{name} must hold integers, got booleans")
        module = type(x).__module__.split(".")[0]
        if self.torch is not None:
            import torch

            if module == "cupy":
                raise TypeError(f"{name} is a CuPy array, the other lengths are torch tensors: pass one kind")
            x = torch.as_tensor(x, device=self.torch.device)
            integer = not (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool)
        elif self.cupy is not None:
            import cupy

            if module == "torch":
                raise TypeError(f"{name} is a torch tensor, the other lengths are CuPy arrays: pass one kind")
            x = cupy.asarray(x)
            integer = x.dtype.kind in "iu"
        else:
            if module in ("torch", "cupy"):
                raise TypeError(f"{name} is a {module} array, the other lengths are host values: pass one kind")
            x = np.asarray(x)
            if x.dtype == object or (x.size == 0 and x.dtype.kind == "f"):
                x = x.astype(np.int64)
            integer = x.dtype.kind in "iu"
        if not integer:
            raise TypeError(f"{name} must hold integers, got dtype {x.dtype}")
        if x.ndim > 1:
            raise ValueError(f"{name} must be one length per request ([B]) or a single int, got shape {tuple(x.shape)}")
        return x

    def host(self, x):
        """NumPy values of a working array when they live on the host (else None: not read)."""
        import numpy as np

        if self.cupy is not None:
            return None
        if self.torch is not None:
            return x.numpy() if x.device.type == "cpu" else None
        return np.asarray(x)

    def full_like(self, x, value):
        return x * 0 + value

    def out(self, x):
        if self.listlike:
            return x.tolist()
        if self.scalar:
            return int(x)
        return x


def _check_count(name, value):
    import numpy as np

    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int (tokens per request), got {value!r}")
    return int(value)


def _require(mode, **named):
    missing = [name for name, value in named.items() if value is None]
    if missing:
        raise ValueError(f"{mode.name} needs {', '.join(missing)}")


def _lengths(mode, named, first):
    """The named length arguments in the caller's kind (that of ``first``, or of the first
    one that is not a single int); host values checked: same number of entries, none negative."""
    given = [named[first]] + [v for k, v in named.items() if k != first and v is not None]
    kind = _Kind(next((v for v in given if not _Kind(v).scalar), given[0]))
    arrays = {name: kind.array(name, value) for name, value in named.items() if value is not None}
    shapes = {name: tuple(a.shape) for name, a in arrays.items()}
    base = shapes[first]
    for name, shape in shapes.items():
        if shape != base and shape != () and base != ():
            raise ValueError(f"{name} has {shape[0]} entries, {first} has {base[0]}: one per request")
    for name, a in arrays.items():
        host = kind.host(a)
        if host is not None:
            bad = np.flatnonzero(np.atleast_1d(host) < 0)
            if bad.size:
                where = f"[{bad[0]}]" if host.ndim else ""
                raise ValueError(f"{mode.name}: {name}{where} = {np.atleast_1d(host)[bad[0]]} is negative")
    return kind, arrays


def _check_not_above(mode, kind, small, small_name, big, big_name, why):
    """Host values: small <= big entry by entry, else a ValueError naming both."""
    s, b = kind.host(small), kind.host(big)
    if s is None or b is None:
        return
    s, b = np.broadcast_arrays(np.atleast_1d(s), np.atleast_1d(b))
    bad = np.flatnonzero(s > b)
    if bad.size:
        i = bad[0]
        raise ValueError(f"{mode.name}: {big_name}[{i}] = {b[i]} is below {small_name.format(i=i)} = {s[i]}: {why}")


def _empty():
    return np.zeros(0, np.int32), np.zeros(0, np.int32)


def contract_lengths(mode, *, prefix_lens=None, new_lens=None, num_draft_tokens=None, accepted_lens=None):
    """``(q_lens, kv_lens)`` of a step from what it adds to each request.

    Args:
        mode: a :class:`ForwardMode` (or its value, e.g. ``"decode"``).
        prefix_lens: ``[B]`` tokens of each request cached BEFORE this step (or one int).
        new_lens: ``[B]`` tokens this step adds (EXTEND chunk, MIXED rows; 1 = a decode row).
        num_draft_tokens: N, a positive int, for TARGET_VERIFY and DRAFT_EXTEND_V2.
        accepted_lens: ``[B]`` accepted tokens A, for DRAFT_EXTEND (v1).
    Returns:
        ``(q_lens, kv_lens)`` in the kind of ``prefix_lens``: lists for lists, ints for an int,
        NumPy / CuPy / torch arrays (same device) for those.
    Raises:
        ValueError: a missing argument, a negative host length, lengths of different batch
            sizes, a non-positive ``num_draft_tokens``. TypeError: non-integer lengths or
            lengths of different frameworks.
    """
    mode = ForwardMode(mode)
    if mode is ForwardMode.IDLE:
        return _empty()
    _require(mode, prefix_lens=prefix_lens)
    if mode in (ForwardMode.EXTEND, ForwardMode.MIXED):
        _require(mode, new_lens=new_lens)
        kind, a = _lengths(mode, dict(prefix_lens=prefix_lens, new_lens=new_lens), "prefix_lens")
        q = a["new_lens"]
    elif mode is ForwardMode.DECODE:
        kind, a = _lengths(mode, dict(prefix_lens=prefix_lens), "prefix_lens")
        q = kind.full_like(a["prefix_lens"], 1)
    elif mode in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2):
        _require(mode, num_draft_tokens=num_draft_tokens)
        n = _check_count("num_draft_tokens", num_draft_tokens)
        kind, a = _lengths(mode, dict(prefix_lens=prefix_lens), "prefix_lens")
        q = kind.full_like(a["prefix_lens"], n)
    else:  # DRAFT_EXTEND v1
        _require(mode, accepted_lens=accepted_lens)
        kind, a = _lengths(mode, dict(prefix_lens=prefix_lens, accepted_lens=accepted_lens), "prefix_lens")
        q = a["accepted_lens"]
    kv = a["prefix_lens"] + q
    if getattr(q, "shape", ()) != getattr(kv, "shape", ()):  # an int prefix with per-request new lengths
        q = q + kv * 0
    return kind.out(q), kind.out(kv)


def from_sglang(mode, seq_lens, *, extend_seq_lens=None, num_draft_tokens=None, accept_lens=None):
    """``(q_lens, kv_lens)`` from sglang's ``forward_batch.seq_lens`` and friends.

    ``seq_lens`` means P + C (EXTEND, MIXED), P + 1 (DECODE), P only
    (TARGET_VERIFY), P + A (DRAFT_EXTEND), P + N (DRAFT_EXTEND_V2: sglang bumps it
    by the draft count before building metadata).

    Returns:
        ``(q_lens, kv_lens)`` in the kind of ``seq_lens`` (see :func:`contract_lengths`).
    Raises:
        ValueError: a missing argument, a negative host length, a host ``seq_lens`` too short
            for the mode's own tokens (``q_len > kv_len``: ``extend_seq_lens`` or
            ``accept_lens`` above ``seq_lens``, a DECODE ``seq_lens`` of 0, a DRAFT_EXTEND_V2
            ``seq_lens`` below N). TypeError: as for :func:`contract_lengths`.
    """
    mode = ForwardMode(mode)
    if mode is ForwardMode.IDLE:
        return _empty()
    if mode in (ForwardMode.EXTEND, ForwardMode.MIXED):
        _require(mode, extend_seq_lens=extend_seq_lens)
        kind, a = _lengths(mode, dict(seq_lens=seq_lens, extend_seq_lens=extend_seq_lens), "seq_lens")
        _check_not_above(mode, kind, a["extend_seq_lens"], "extend_seq_lens[{i}]", a["seq_lens"], "seq_lens",
                         "sglang's seq_lens counts the prefix and this step's tokens (P + C)")
        q, kv = a["extend_seq_lens"], a["seq_lens"]
    elif mode is ForwardMode.DECODE:
        kind, a = _lengths(mode, dict(seq_lens=seq_lens), "seq_lens")
        kv = a["seq_lens"]
        q = kind.full_like(kv, 1)
        _check_not_above(mode, kind, q, "the step's one new token", kv, "seq_lens",
                         "sglang's DECODE seq_lens already counts the new token (P + 1)")
    elif mode is ForwardMode.TARGET_VERIFY:
        _require(mode, num_draft_tokens=num_draft_tokens)
        n = _check_count("num_draft_tokens", num_draft_tokens)
        kind, a = _lengths(mode, dict(seq_lens=seq_lens), "seq_lens")
        q, kv = kind.full_like(a["seq_lens"], n), a["seq_lens"] + n
    elif mode is ForwardMode.DRAFT_EXTEND:
        _require(mode, accept_lens=accept_lens)
        kind, a = _lengths(mode, dict(seq_lens=seq_lens, accept_lens=accept_lens), "seq_lens")
        _check_not_above(mode, kind, a["accept_lens"], "accept_lens[{i}]", a["seq_lens"], "seq_lens",
                         "sglang's DRAFT_EXTEND seq_lens counts the prefix and the accepted tokens (P + A)")
        q, kv = a["accept_lens"], a["seq_lens"]
    else:  # DRAFT_EXTEND_V2
        _require(mode, num_draft_tokens=num_draft_tokens)
        n = _check_count("num_draft_tokens", num_draft_tokens)
        kind, a = _lengths(mode, dict(seq_lens=seq_lens), "seq_lens")
        kv = a["seq_lens"]
        q = kind.full_like(kv, n)
        _check_not_above(mode, kind, q, "num_draft_tokens", kv, "seq_lens",
                         f"sglang's DRAFT_EXTEND_V2 seq_lens is already bumped by the {n} drafts (P + N)")
    if getattr(q, "shape", ()) != getattr(kv, "shape", ()):
        q, kv = q + kv * 0, kv + q * 0
    return kind.out(q), kind.out(kv)
