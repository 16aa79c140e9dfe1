"""What `plan`'s one host-to-device copy costs the host, by the kind of host memory, on a GPU machine:
`cudaMemcpyAsync` of the bytes a host step stages (its lengths and a mirrored page table: 1, 16 and
128 KiB) from pageable NumPy memory (what `PlanBuffers.host_inputs` is) and from pinned memory
(`cupy.cuda.alloc_pinned_memory`), each timed alone after a sync (the median of many, and the least);
then what a pinned mirror would add to stay safe against its own pending copy: an event's record
and its query. Written 2026-12-07 (issue 41: `plan` 41-43 us on two cells against the bar of 40,
about 7.5 us of it this copy on an H100 host): a pinned mirror is worth building only if the copy
and the query together cost clearly less than the pageable copy.

    PYTHONPATH=. python3 lab/host_copy_probe.py      (a GPU machine)
"""

import numpy as np
from host_launch_probe import host_us  # (median, least) us of one call after a sync (lab/ on the path)


def main():
    import cupy

    runtime = cupy.cuda.runtime
    stream = cupy.cuda.Stream(non_blocking=True)
    sync = stream.synchronize
    print(f"{'bytes':>8s} {'pageable med/min':>18s} {'pinned med/min':>16s}   (us of host time a cudaMemcpyAsync)")
    for nbytes in (1 << 10, 16 << 10, 128 << 10):
        dst = cupy.empty(nbytes // 4, np.int32)
        pageable = np.ones(nbytes // 4, np.int32)
        mem = cupy.cuda.alloc_pinned_memory(nbytes)
        pinned = np.frombuffer(mem, np.int32, nbytes // 4)
        pinned[:] = 1
        row = []
        for src in (pageable, pinned):
            ptr = src.ctypes.data
            row.append(host_us(lambda: runtime.memcpyAsync(dst.data.ptr, ptr, nbytes, runtime.memcpyHostToDevice,
                                                           stream.ptr), sync))
        print(f"{nbytes:8d} {row[0][0]:9.1f} /{row[0][1]:6.1f} {row[1][0]:8.1f} /{row[1][1]:6.1f}")
    event = cupy.cuda.Event(disable_timing=True)
    record = host_us(lambda: event.record(stream), sync)
    event.record(stream)
    sync()
    query = host_us(lambda: event.done, sync)
    print(f"event record {record[0]:.1f} / {record[1]:.1f} us, query (done) {query[0]:.1f} / {query[1]:.1f} us")


if __name__ == "__main__":
    main()
