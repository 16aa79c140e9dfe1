"""What a plan reuses of the plans before it: the schedule of a step of the same shape.

``schedule.schedule_step`` is pure policy (no device), but it costs tens of microseconds of NumPy
per call. A decode step's lengths change every step while its schedule changes every few hundred
(when a request crosses a split boundary), so a :class:`ScheduleMemo` keeps the last schedules of
an instance, keyed by exactly what the policy reads:

* host lengths: ``q_lens`` and ``ceil(kv_len / split_size)`` per request, and where a sliding window
  cuts its keys ``schedule.window_quotient`` (not clamped: its positive part is
  ``schedule.key_base_units``, the request's key base in whole merge groups of splits, and its
  window span's splits are the first quotient less that many groups' splits, so the pair fixes
  them; unclamped it costs fewer array passes and changes only every merge group's keys where the
  clamp would hold it at 0). Every count the host policy
  derives from ``kv_len`` (``schedule.max_splits``: the splits a request gets, ``work_bound``,
  ``needs_merge``, ``fold_tile``) is a function of that quotient and ``q_len``, so two batches of
  one key plan alike (``tests/test_host_path_cpu.py`` holds memoised schedules to fresh ones over
  random batches);
* device lengths: the bounds (``max_q_len``, ``max_kv_len``), the capacity and the batch size;

and the window, the device (shared memory, SMs, arch) and the knobs in force (a knob change
empties the memo).
"""

from . import schedule
from .knobs import knobs

SIZE = 64  # schedules kept per instance (oldest out first)


class Memo:
    """The last :data:`SIZE` values of a pure function by key (oldest out first), emptied when the
    knobs in force change; the rule both schedule memos share (this module's, MHA's, and
    cupy_fa.mla.schedule's). A caller looks a key up (:meth:`lookup`, None on a miss) and keeps
    what it computed on a miss (:meth:`keep`)."""

    def __init__(self):
        self._found, self._knobs = {}, None
        self.hits = self.misses = 0

    def knobs_changed(self):
        """Whether the knobs in force are others than at the last call (then the memo is emptied)."""
        k = knobs()
        if k is self._knobs:
            return False
        self._found, self._knobs = {}, k
        return True

    def lookup(self, key):
        found = self._found.get(key)
        if found is not None:
            self.hits += 1
        return found

    def keep(self, key, value):
        self.misses += 1
        if len(self._found) >= SIZE:
            del self._found[next(iter(self._found))]
        self._found[key] = value
        return value


class ScheduleMemo(Memo):
    """``schedule.schedule_step`` for one attention shape (head dim, group, KV heads, KV element
    bytes), with the schedules of the last :data:`SIZE` keys kept."""

    def __init__(self, head_dim, group_size, num_kv_heads, kv_bytes, head_dim_vo=None):
        super().__init__()
        self.shape = (head_dim, group_size, num_kv_heads)
        self.kv_bytes, self.head_dim_vo = kv_bytes, head_dim_vo
        self._split = None

    def step(self, q_lens=None, kv_lens=None, *, max_q_len=None, max_kv_len=None, capacity=None, batch_size=None,
             smem_limit, sm_count, arch, window=0):
        """What ``schedule.schedule_step`` gives for these arguments (host lengths ``q_lens`` /
        ``kv_lens`` as int64 arrays, or device-length bounds)."""
        if self.knobs_changed():
            self._split = schedule.split_size(self.kv_bytes)  # (a knob)
        device = (smem_limit, sm_count, arch, window)
        if q_lens is not None:
            split = self._split
            key = (device, q_lens.tobytes(), ((kv_lens + (split - 1)) // split).tobytes())
            if window:
                key += (schedule.window_quotient(q_lens, kv_lens, window, schedule.MERGE_GROUP * split).tobytes(),)
        else:
            key = (device, max_q_len, max_kv_len, capacity, batch_size)
        found = self.lookup(key)
        if found is not None:
            return found
        return self.keep(key, schedule.schedule_step(
            *self.shape, q_lens=q_lens, kv_lens=kv_lens, max_q_len=max_q_len, max_kv_len=max_kv_len,
            capacity=capacity, batch_size=batch_size, smem_limit=smem_limit, sm_count=sm_count, arch=arch,
            kv_bytes=self.kv_bytes, window=window, head_dim_vo=self.head_dim_vo))
