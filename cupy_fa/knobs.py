"""The ``CUPY_FA_*`` environment variables, read once into one frozen :class:`Knobs`.

Every knob the library has is a field here; nothing else reads the environment. The first call
of :func:`knobs` reads it (and raises ``ValueError`` naming the variable and what it accepts);
the object is then kept, so no plan or launch re-reads anything. A program (or a test) that
changes a variable afterwards calls :func:`reload` to take it in, or :func:`use` to install a
``Knobs`` it built (``dataclasses.replace(knobs(), split_size=1024)``).

What each knob means, its values and its default: the "Environment variables" table of
README.md (the one table; each field below names its variable). The tuning knobs never change
results, except ``CUPY_FA_SPLIT_SIZE`` and ``CUPY_FA_MLA_SPLIT_SIZE``, which decode and verify must
share for their bits to match (docs/design.md, "Batch invariance"), ``CUPY_FA_SOFT_CAP_TANH`` and
``CUPY_FA_MLA_WGMMA`` (another kernel for the same MLA step).

Changing a knob that selects kernels (stages, warps, split size, splits per CTA, fold) affects
plans made after the change; a graph captured before keeps what it froze.
"""

from __future__ import annotations

import dataclasses
import os
import threading

STAGE_CHOICES = (2, 3, 4)  # cp.async pipeline depths a decode-like tile may use
MAX_SPLITS_PER_CTA = 64  # keeps the kernels' split arithmetic in int32
SOFT_CAP_TANH_FORMS = ("exact", "approx", "newton")  # the soft-cap's tanh forms 0, 1, 2 (families.sm90)
# the spellings a boolean knob takes (case-insensitive); anything else raises
_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")


@dataclasses.dataclass(frozen=True)
class Knobs:
    arch: str | None = None          # CUPY_FA_ARCH: compile for this target instead of the device's
    cache_dir: str | None = None     # CUPY_FA_CACHE_DIR: the compiled-kernel cache (cupy_fa/_cache.py;
                                     # default $XDG_CACHE_HOME/cupy_fa, i.e. ~/.cache/cupy_fa)
    decode_stages: int = 2           # CUPY_FA_DECODE_STAGES: 2, 3 or 4
    decode_warps_m: int | None = None  # CUPY_FA_DECODE_WARPS_M: 1, 2, or None for auto
    split_size: int | None = None    # CUPY_FA_SPLIT_SIZE: keys per split of small-q requests, every
                                     # cache (None: schedule.split_size's default per K/V element)
    splits_per_cta: int = 1          # CUPY_FA_SPLITS_PER_CTA: 1 .. MAX_SPLITS_PER_CTA
    fold_splits: str = "auto"        # CUPY_FA_FOLD_SPLITS: "auto", "0" or "1"
    pdl: bool = True                 # CUPY_FA_PDL: programmatic launch of the merge kernel (sm_90+)
    trace: bool = False              # CUPY_FA_TRACE: compile the timeline stamps in (diagnosis)
    debug: bool = False              # CUPY_FA_DEBUG: plans check the device status word (syncs) and raise
    half_rows: bool = True           # CUPY_FA_HALF_ROWS: "0" keeps fp8 decode of <= 8 rows on the full
                                     # 16-row softmax (schedule.tile_for; for A/B runs)
    producer_warp: bool = True       # CUPY_FA_PRODUCER_WARP: "0" keeps the fp8 one-row-half decode tile's
                                     # copies on its consumer warps (schedule.tile_for; for A/B runs)
    mla_wgmma: bool = True           # CUPY_FA_MLA_WGMMA: "0" runs every MLA step on the mma.sync tile
                                     # (cupy_fa.mla.schedule; for A/B runs and isolating a kernel)
    mla_wgmma_fp8: bool = True       # CUPY_FA_MLA_WGMMA_FP8: "0" keeps fp8 latent caches on the mma.sync tile
                                     # (cupy_fa.mla.schedule; for A/B runs)
    mla_wgmma_min_heads: int | None = None  # CUPY_FA_MLA_WGMMA_MIN_HEADS: the fewest heads whose small-q
                                     # steps take the seesaw kernel (None: cupy_fa.mla.schedule.WGMMA_MIN_HEADS)
    mla_split_size: int | None = None  # CUPY_FA_MLA_SPLIT_SIZE: keys a split of a small-q MLA request, a
                                     # multiple of 64 (None: cupy_fa.mla.schedule.split_size by head count)
    soft_cap_tanh: str | None = None  # CUPY_FA_SOFT_CAP_TANH: approx, exact or newton, the wgmma prefill
                                     # family's tanh of a soft-cap (None: families.sm90.SOFT_CAP_TANH)

    def __post_init__(self):
        _check(self.decode_stages in STAGE_CHOICES, "CUPY_FA_DECODE_STAGES",
               f"one of {STAGE_CHOICES}", self.decode_stages)
        _check(self.decode_warps_m in (None, 1, 2), "CUPY_FA_DECODE_WARPS_M", "auto, 1 or 2", self.decode_warps_m)
        _check(self.split_size is None
               or (isinstance(self.split_size, int) and self.split_size >= 64 and self.split_size % 64 == 0),
               "CUPY_FA_SPLIT_SIZE", "a positive multiple of 64 keys", self.split_size)
        _check(isinstance(self.splits_per_cta, int) and 1 <= self.splits_per_cta <= MAX_SPLITS_PER_CTA,
               "CUPY_FA_SPLITS_PER_CTA", f"an int in 1..{MAX_SPLITS_PER_CTA}", self.splits_per_cta)
        _check(self.fold_splits in ("auto", "0", "1"), "CUPY_FA_FOLD_SPLITS", "auto, 0 or 1", self.fold_splits)
        _check(self.mla_split_size is None or (isinstance(self.mla_split_size, int) and self.mla_split_size >= 64
                                               and self.mla_split_size % 64 == 0),
               "CUPY_FA_MLA_SPLIT_SIZE", "a positive multiple of 64 keys", self.mla_split_size)
        _check(self.mla_wgmma_min_heads is None or (isinstance(self.mla_wgmma_min_heads, int)
                                                    and self.mla_wgmma_min_heads >= 1),
               "CUPY_FA_MLA_WGMMA_MIN_HEADS", "a positive number of heads", self.mla_wgmma_min_heads)
        _check(self.soft_cap_tanh in (None,) + SOFT_CAP_TANH_FORMS, "CUPY_FA_SOFT_CAP_TANH",
               ", ".join(SOFT_CAP_TANH_FORMS[:-1]) + " or " + SOFT_CAP_TANH_FORMS[-1], self.soft_cap_tanh)

    @classmethod
    def from_environ(cls, environ=None) -> Knobs:
        """The knobs an environment (``os.environ`` by default) sets; unset ones take their default."""
        env = os.environ if environ is None else environ

        def get(name):
            value = env.get(name)
            return None if value is None or value == "" else value

        def integer(name, default):
            value = get(name)
            if value is None:
                return default
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"{name} must be an int, got {value!r}") from None

        def flag(name, default):
            value = get(name)
            if value is None:
                return default
            word = value.strip().lower()
            if word not in _TRUE + _FALSE:
                raise ValueError(f"{name} must be 0 or 1 (or true / false, on / off, yes / no), got {value!r}")
            return word in _TRUE

        warps = get("CUPY_FA_DECODE_WARPS_M") or "auto"
        if warps not in ("auto", "1", "2"):
            raise ValueError(f"CUPY_FA_DECODE_WARPS_M must be auto, 1 or 2, got {warps!r}")
        return cls(arch=get("CUPY_FA_ARCH"), cache_dir=get("CUPY_FA_CACHE_DIR"),
                   decode_stages=integer("CUPY_FA_DECODE_STAGES", cls.decode_stages),
                   decode_warps_m=None if warps == "auto" else int(warps),
                   split_size=integer("CUPY_FA_SPLIT_SIZE", cls.split_size),
                   splits_per_cta=integer("CUPY_FA_SPLITS_PER_CTA", cls.splits_per_cta),
                   fold_splits=get("CUPY_FA_FOLD_SPLITS") or "auto",
                   half_rows=flag("CUPY_FA_HALF_ROWS", cls.half_rows),
                   producer_warp=flag("CUPY_FA_PRODUCER_WARP", cls.producer_warp),
                   mla_wgmma=flag("CUPY_FA_MLA_WGMMA", cls.mla_wgmma),
                   mla_wgmma_fp8=flag("CUPY_FA_MLA_WGMMA_FP8", cls.mla_wgmma_fp8),
                   mla_wgmma_min_heads=integer("CUPY_FA_MLA_WGMMA_MIN_HEADS", cls.mla_wgmma_min_heads),
                   mla_split_size=integer("CUPY_FA_MLA_SPLIT_SIZE", cls.mla_split_size),
                   soft_cap_tanh=(get("CUPY_FA_SOFT_CAP_TANH") or "").strip().lower() or None,
                   pdl=flag("CUPY_FA_PDL", cls.pdl), trace=flag("CUPY_FA_TRACE", cls.trace),
                   debug=flag("CUPY_FA_DEBUG", cls.debug))


def _check(ok, name, expected, value):
    if not ok:
        raise ValueError(f"{name} must be {expected}, got {value!r}")


_lock = threading.Lock()
_current: Knobs | None = None


def knobs() -> Knobs:
    """The knobs in force: the environment's at the first call, unless :func:`use` or
    :func:`reload` installed others since."""
    current = _current
    if current is None:
        with _lock:
            if _current is None:
                use(Knobs.from_environ())
            current = _current
    return current


def use(new: Knobs) -> Knobs:
    """Installs ``new`` as the knobs in force; returns the previous ones (``None`` if none were
    read yet), so a caller can put them back."""
    global _current
    if not isinstance(new, Knobs):
        raise TypeError(f"expected a cupy_fa.knobs.Knobs, got {type(new).__name__}")
    previous, _current = _current, new
    return previous


def reload(environ=None) -> Knobs:
    """Reads the environment again (after a program changed a ``CUPY_FA_*`` variable) and
    installs the result; raises ``ValueError`` (and keeps the knobs in force) on a bad value."""
    new = Knobs.from_environ(environ)
    use(new)
    return new
