"""The compiled-kernel cache on disk: one file per compiled program, ``<key>.cubin``, in the
directory the knob ``CUPY_FA_CACHE_DIR`` names (default ``$XDG_CACHE_HOME/cupy_fa``, i.e.
``~/.cache/cupy_fa``: the directory ``cupy_fa.demo`` keeps its compile table in).

Nothing here touches CUDA: :mod:`cupy_fa._build` compiles, loads and launches; this module only
names, writes, reads and checks the bytes.

* The key (:func:`key`) is a SHA-256 of everything the binary depends on: the program text (which
  carries the hash of ``kernels/`` through ``-DCUPY_FA_SOURCE_HASH``), the name expression, the
  full NVRTC option list, the target arch and the NVRTC version, and :data:`FORMAT`.
* An entry is a small header and the cubin (:func:`encode`): the magic ``CUPYFA`` and the format
  byte, a JSON header (the key, the lowered (mangled) name of the kernel, the cubin's length and
  SHA-256), then the cubin exactly as NVRTC's ``getCUBIN`` gave it (the bytes ``cupy.RawModule``
  hands the driver). :func:`decode` checks all of it: a truncated, corrupt or foreign entry reads
  as missing, so it is rebuilt and never loaded.
* Writes are atomic (:func:`store`): a temporary file in the same directory, then ``os.replace``;
  a reader sees no entry or a whole one. Processes compiling the same program into one directory
  (one per GPU under tensor parallel) take a per-entry lock (:func:`locked`: ``flock`` on
  ``<key>.lock``, released when the holder exits, however it exits) so one compiles and the
  others load its entry; where locks do not work the atomic rename alone keeps every reader
  correct (they then compile the same bytes more than once).
* A directory that cannot be created or written (read-only, another user's) is not an error: the
  caller compiles in memory, and :func:`warn_unwritable` says so once per process.

Why a cache of our own rather than CuPy's (CuPy 14.2, cupy/cuda/compiler.py, 2026-12-04): CuPy's
disk cache is atomic (a temporary file and ``os.replace``) and checksummed (SHA-1 prefix), but
filling it without a device means rebuilding its private key (the ``-arch=sm_XY`` it derives from
the device, the output of a preprocessed empty program, its header checksum, the name-expression
payload format new in 14.x) and its entry format, which change between CuPy releases; its
directory is read once, when ``cupy`` is imported (so setting ``CUPY_CACHE_DIR`` afterwards, as
cupy_fa did for ``CUPY_FA_CACHE_DIR``, had no effect); an unwritable directory raises instead of
falling back; and there is no lock, so eight ranks starting together compile every kernel eight
times. Ours is written by NVRTC worker processes with no device and read back by the same code.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import struct
import tempfile
import warnings

FORMAT = 1
MAGIC = b"CUPYFA\x00" + bytes([FORMAT])  # 8 bytes; the leading byte is not ELF's 0x7f
SUFFIX = ".cubin"
_HEADER_LIMIT = 1 << 16  # a JSON header longer than this is not one of ours


class CacheUnwritable(OSError):
    """The cache directory could not be created or written."""


def default_dir():
    """Where compiled kernels go without ``CUPY_FA_CACHE_DIR``: ``$XDG_CACHE_HOME/cupy_fa``, else
    ``~/.cache/cupy_fa`` (the rule ``cupy_fa.demo.compile_cache_dir`` follows)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "cupy_fa")


def cache_dir():
    """The directory in force: the knob ``CUPY_FA_CACHE_DIR``, else :func:`default_dir`."""
    from .knobs import knobs

    return knobs().cache_dir or default_dir()


def key(text, expression, options, arch, nvrtc_version):
    """The entry name (64 hex digits) of one program compiled with these options for ``arch`` by
    NVRTC ``nvrtc_version`` (a (major, minor) pair)."""
    if not isinstance(arch, str) or not arch:
        raise ValueError(f"arch must be a target name such as 'sm_90a', got {arch!r}")
    facts = {"format": FORMAT, "text": text, "expression": expression, "options": list(options), "arch": arch,
             "nvrtc": list(nvrtc_version)}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


def path_of(directory, entry_key):
    return os.path.join(directory, entry_key + SUFFIX)


def encode(entry_key, lowered, cubin):
    """The bytes of one entry: MAGIC, the header's length (uint32 LE), the JSON header, the cubin."""
    if not isinstance(cubin, (bytes, bytearray)) or not cubin:
        raise ValueError("cubin must be non-empty bytes")
    header = json.dumps({"key": entry_key, "lowered": lowered, "size": len(cubin),
                         "sha256": hashlib.sha256(cubin).hexdigest()}, sort_keys=True).encode()
    return MAGIC + struct.pack("<I", len(header)) + header + bytes(cubin)


def decode(data, entry_key):
    """``(lowered name, cubin)`` of an entry's bytes if they are a whole, intact entry of
    ``entry_key``; ``None`` otherwise (truncated, corrupt, another key's, another format's)."""
    if len(data) < len(MAGIC) + 4 or not data.startswith(MAGIC):
        return None
    (size,) = struct.unpack_from("<I", data, len(MAGIC))
    start = len(MAGIC) + 4
    if size > _HEADER_LIMIT or len(data) < start + size:
        return None
    try:
        header = json.loads(data[start:start + size])
        lowered, length, digest = header["lowered"], header["size"], header["sha256"]
        stored_key = header["key"]
    except (ValueError, KeyError, TypeError):
        return None
    cubin = data[start + size:]
    if (stored_key != entry_key or not isinstance(lowered, str) or not lowered or length != len(cubin)
            or hashlib.sha256(cubin).hexdigest() != digest or not _is_image(cubin)):
        return None
    return lowered, cubin


def _is_image(data):
    """A cubin (ELF) or the NUL-ended PTX text of a virtual target's build."""
    return data.startswith(b"\x7fELF") or (data.startswith(b"//") and data.endswith(b"\0"))


def load(directory, entry_key):
    """The checked ``(lowered name, cubin)`` of an entry, or ``None`` (no entry, an unreadable one,
    a bad one: :func:`decode`)."""
    try:
        with open(path_of(directory, entry_key), "rb") as f:
            data = f.read()
    except OSError:
        return None
    return decode(data, entry_key)


def store(directory, entry_key, lowered, cubin):
    """Writes an entry atomically (a temporary file in ``directory``, then ``os.replace``); raises
    :class:`CacheUnwritable` when the directory cannot be created or written."""
    data = encode(entry_key, lowered, cubin)
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix="." + entry_key[:16] + ".", suffix=".tmp")
    except OSError as exc:
        raise CacheUnwritable(str(exc)) from exc
    try:
        with os.fdopen(fd, "wb") as f:
            if hasattr(os, "fchmod"):
                os.fchmod(f.fileno(), 0o644)  # mkstemp's 0600 would hide the entry from other users
            f.write(data)
        os.replace(tmp, path_of(directory, entry_key))
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise CacheUnwritable(str(exc)) from exc


def writable(directory):
    """Whether entries can be written to ``directory`` (created if missing): a probe file is made
    and removed."""
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".probe.", suffix=".tmp")
    except OSError:
        return False
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(tmp)
    return True


@contextlib.contextmanager
def locked(directory, entry_key):
    """Holds the cross-process lock of one entry (``flock`` on ``<key>.lock``) for the block; a
    no-op where the lock file cannot be made or locks are not supported (correctness never needs
    it: :func:`store` is atomic, so the lock only saves compiling the same program twice)."""
    try:
        import fcntl
    except ImportError:  # no flock on this platform
        yield
        return
    try:
        os.makedirs(directory, exist_ok=True)
        fd = os.open(os.path.join(directory, entry_key + ".lock"), os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass  # e.g. ENOLCK on a network file system: go on unlocked
        yield
    finally:
        os.close(fd)  # releases the lock


_warned = set()


def warn_unwritable(directory, reason=""):
    """One warning per process (and directory) that compiled kernels are not being cached."""
    directory = str(pathlib.Path(directory))
    if directory in _warned:
        return
    _warned.add(directory)
    warnings.warn(f"cupy_fa: the kernel cache directory {directory} cannot be written"
                  f"{' (' + reason + ')' if reason else ''}; kernels are compiled in memory and not cached "
                  "(set CUPY_FA_CACHE_DIR to a writable directory)", RuntimeWarning, stacklevel=3)
