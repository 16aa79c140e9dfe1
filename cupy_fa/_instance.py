"""What the two attention APIs share as instances (``cupy_fa.BatchAttention`` and
``cupy_fa.mla.MLAAttention``): the capacity arguments, the device an instance is bound to, one call
at a time, metadata buffers grown by eager plans, a plan ordered after the streams of the plan
before it and a run after its own plan (events, no host sync), and the status word.

:class:`PlannedInstance` is their base; each class keeps what is its own: its checks, its schedule
and launches, and its buffers (:meth:`PlannedInstance._new_buffers`). A plan state (``_plan``) has
``stream`` (the stream its plan kernel ran on), ``done`` (the event recorded after it; None when
planned inside a capture) and ``other_streams`` (ptr -> stream of its runs on other streams).
"""

import contextlib
import threading
import warnings

from . import _arrays, plan as _plan, status as _status


def checked_capacity(max_batch_size, max_num_tokens, max_pages_per_request, max_mask_bytes):
    """The constructor's capacity arguments as a ``plan.Capacity``, or None where none of the first
    three is given (buffers sized on first use, grown by eager plans). ValueError for some but not
    all of them, or a count that is not an int >= 1 (``max_mask_bytes``: >= 0)."""
    given = (max_batch_size, max_num_tokens, max_pages_per_request)
    fixed = all(v is not None for v in given)
    if any(v is not None for v in given) and not fixed:
        raise ValueError("give all of max_batch_size, max_num_tokens, max_pages_per_request, or none")
    if fixed:
        for name, value in zip(("max_batch_size", "max_num_tokens", "max_pages_per_request"), given):
            _plan.check_count(name, value, 1)
    _plan.check_count("max_mask_bytes", max_mask_bytes, 0)
    return _plan.Capacity(*(int(v) for v in given), int(max_mask_bytes)) if fixed else None


def checked_workspace(workspace_bytes):
    """The constructor's ``workspace_bytes`` (the split partials' size): None (the class's default) or an
    int >= 1, else ValueError naming it."""
    if workspace_bytes is not None:
        _plan.check_count("workspace_bytes", workspace_bytes, 1)
    return workspace_bytes


class PlannedInstance:
    """The base of the attention APIs: :meth:`_bind` (from the constructor, after its own checks)
    binds the device and, for a fixed ``capacity``, allocates the buffers (:meth:`_new_buffers`)."""

    _NAME = "instance"  # the class's public name, for messages

    def _bind(self, device, capacity):
        # the bound device: given, else the current one (None on a machine without CUDA, where the
        # first plan raises saying why)
        self.device_id = _arrays.resolve_device(device) if device is not None else _arrays.current_device_id()
        self._device = None  # its cupy.cuda.Device (device_scope), made on first use
        self._fixed_capacity = capacity is not None
        self._buffers = None
        self._retired = []  # outgrown buffers, kept alive (see _ensure_capacity)
        self._plan = None
        self._busy = threading.Lock()  # held by the thread inside plan() or run() (see _enter)
        self._busy_with = None
        self._overflow_said = False  # _check_partials has warned
        if capacity is not None:
            with self.device_scope():
                self._buffers = self._new_buffers(capacity)

    def _new_buffers(self, capacity):
        """The class's ``plan.PlanBuffers`` for ``capacity`` (on the current device)."""
        raise NotImplementedError

    def device_scope(self):
        """The bound device as a ``cupy.cuda.Device``, a context manager: every plan and run enters
        it once (allocations, kernel lookups, launches and captures happen on it)."""
        device = self._device
        if device is None:
            if self.device_id is None:
                self.device_id = _arrays.current_device_id()
                if self.device_id is None:  # no usable CUDA device: host inputs are still checked first,
                    return contextlib.nullcontext()  # then the first call that needs the device says why
            import cupy

            device = self._device = cupy.cuda.Device(self.device_id)
        return device

    @property
    def _bound_text(self):
        return f"the device this {self._NAME} is bound to (device={self.device_id})"

    # ---- one call at a time ------------------------------------------------------------

    def _enter(self, call):
        """One call at a time per instance: a second thread raises instead of racing on the buffers."""
        if not self._busy.acquire(blocking=False):
            holder = self._busy_with or (None, "plan() or run")  # it may just have left
            name = holder[0].name if holder[0] is not None else "another thread"
            raise RuntimeError(
                f"{self._NAME}.{call}() on thread {threading.current_thread().name!r} while thread "
                f"{name!r} is inside {holder[1]}() of the same instance: one instance's metadata buffers "
                f"serve one call at a time; use one {self._NAME} per thread")
        self._busy_with = (threading.current_thread(), call)

    def _leave(self):
        self._busy_with = None
        self._busy.release()

    # ---- streams and buffers -----------------------------------------------------------

    def _order_after_previous(self, stream, capturing):
        """A plan on another stream than the previous plan (or its runs) first waits for the work
        queued there: it rewrites the metadata those kernels read. An event per stream that
        changed, no host sync; inside a capture the capturing code orders the capture itself."""
        previous = self._plan
        if previous is None or capturing:
            return
        for other in (previous.stream, *previous.other_streams.values()):
            if other is not None and other.ptr != stream.ptr and not other.is_capturing():
                stream.wait_event(other.record())

    def _after_plan(self, state, stream, capturing):
        """A run on another stream than its plan's waits for the plan kernel (its event), and the
        next plan waits for that stream (``other_streams``)."""
        if stream.ptr != state.stream.ptr and not capturing:
            if state.done is not None:
                stream.wait_event(state.done)  # planned on another stream: order after its metadata
            state.other_streams.setdefault(stream.ptr, stream)  # the next plan waits for it

    def _ensure_capacity(self, batch, tokens, pages, mask_bytes, capturing, stream):
        """Buffers that fit the step: the current ones, else (an instance sized on first use, outside
        a capture) larger ones made on ``stream``; ValueError naming the step and the capacity for a
        fixed instance or inside a capture."""
        buffers = self._buffers
        if buffers is not None and buffers.capacity.fits(batch, tokens, pages, mask_bytes):
            return
        if self._fixed_capacity or capturing:
            cap = buffers.capacity if buffers is not None else None
            raise ValueError(f"step (batch {batch}, tokens {tokens}, page-table columns {pages}, mask bytes "
                             f"{mask_bytes}) exceeds the capacity {cap} this {self._NAME} was built with")
        base = buffers.capacity if buffers is not None else _plan.Capacity(1, 1, 1, 0)
        if buffers is not None:
            # a graph captured earlier (or a run still in flight on another stream) may read
            # the old buffers: keep them alive rather than hand their memory back
            self._retired.append(buffers)
        with stream:  # allocations (and their memsets) ordered with the copies that follow
            self._buffers = self._new_buffers(base.grown_to(batch, tokens, pages, mask_bytes))

    def _check_partials(self, wanted):
        """A host-planned batch that wants ``wanted`` split-partial rows (its schedule's
        ``partial_rows``; None for device lengths): more than the buffers hold, and plan_kernel caps
        its splits, so its results may depend on the batch. Said once per instance, with the
        ``workspace_bytes`` that would hold it (plan.BatchInvarianceWarning)."""
        buffers = self._buffers
        if wanted is None or wanted <= buffers.partial_out.shape[0] or self._overflow_said:
            return
        self._overflow_said = True
        have, row = buffers.partial_out.shape[0], buffers.partial_row_bytes
        warnings.warn(
            f"{self._NAME}.plan: this batch's split partials need {wanted} rows ({wanted * row / 2**20:.0f} MiB) "
            f"and the workspace holds {have} ({have * row / 2**20:.0f} MiB): every request's splits are capped "
            f"at an equal share, so results may depend on the rest of the batch (decode == verify bits are not "
            f"kept for such steps). Construct with workspace_bytes >= {wanted * row} to keep them; said once "
            f"per instance", _plan.BatchInvarianceWarning, stacklevel=5)

    # ---- the status word ---------------------------------------------------------------

    def status(self):
        """The device status word of the current plan and its runs so far (syncs on their streams):
        a :class:`cupy_fa.status.Status`, an ``int`` that is 0 when every request was within the
        contract, else 1 + the first bad request's index, with ``.request``, ``.reason`` and
        ``.what`` and a sentence for ``str()``: e.g. ``request 3: a page id it reads is not a page
        of the cache``. The plan kernel records refused lengths (negative q_len, q_len > kv_len,
        q_len > max_q_len, kv_len > max_kv_len), the attention kernel the rest (page ids outside
        the cache, kv_len past the page table's columns, rows past q, a custom mask too short)."""
        if self._buffers is None or self._plan is None:
            return _status.Status(_status.OK)
        state = self._plan
        with self.device_scope() as device:
            if state.done is None:  # planned inside a capture: its replays run on streams unknown here
                device.synchronize()
            for stream in (state.stream, *state.other_streams.values()):
                if stream is not None and not stream.is_capturing():
                    stream.synchronize()
            return _status.read(self._buffers.status)

    def _raise_on_bad(self, call):
        found = self.status()
        if not found.ok:
            raise ValueError(f"{call}(check=True): {found}: the device metadata breaks the contract "
                             f"(its rows of out are NaN; docs/errors.md)")
