"""The attention kernel families, one module each with the tiles it has:

* :mod:`.mma_sync`: ``kernels/mma_sync/``, mma.sync m16n8k16 on sm_80 and newer; the small-q
  tiles (decode-like requests) and a prefill tile;
* :mod:`.sm90`: ``kernels/sm90/``, wgmma with a producer warpgroup on sm_90a; prefill at head
  dims 64, 96, 128, 192 and 256 over a 16-bit cache, 64, 128 and 256 over an fp8 (e4m3) cache;
* :mod:`.common`: what they share (head dims, element types, device limits).

:mod:`.mla` (``kernels/mla/``) is multi-head latent attention's family, behind
``cupy_fa.mla.MLAAttention`` (its tiles picked by :mod:`cupy_fa.mla.schedule`).

A tile names its family (``tile.family``), its C++ traits (``tile.traits()``) and the host
mirrors checked at compile time (``tile.checks()``); :mod:`cupy_fa.schedule` picks the tiles,
:mod:`cupy_fa.catalog` turns them into compiled kernels.
"""

from .common import ElementTypes, KernelFamily
from .mma_sync import MMA_SYNC, MmaTile
from .sm90 import SM90_WGMMA, Sm90Tile

FAMILIES = (MMA_SYNC, SM90_WGMMA)


def family_of(tile):
    """The :class:`KernelFamily` whose kernel a tile instantiates."""
    return tile.family


def is_small_q_tile(tile):
    """A tile of the small-q class (mma.sync, 4 warps over each KV tile's keys)."""
    return isinstance(tile, MmaTile) and tile.warps_n > 1


__all__ = ["FAMILIES", "MMA_SYNC", "SM90_WGMMA", "ElementTypes", "KernelFamily", "MmaTile", "Sm90Tile", "family_of",
           "is_small_q_tile"]
