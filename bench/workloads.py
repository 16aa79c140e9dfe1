"""The benchmark workloads and what each must move and compute (pure Python, no GPU).

Every workload is bf16, H_q = 32 query heads, H_kv = 8 KV heads, head dim 128, the same
q_len / kv_len for every request of the batch, causal (bottom-right aligned,
docs/design.md "The contract"). Each runs at page size 16 and page size 1 with a shuffled page table.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass

H_Q, H_KV, HEAD_DIM = 32, 8, 128
DTYPE, DTYPE_BYTES = "bfloat16", 2
PAGE_SIZES = (16, 1)

# The H200's ceilings as measured before v1 (bench/NOTES.md "Floors"): used for the written floors and as fallbacks
# when a ceiling could not be measured in the run.
REFERENCE_READ_TBPS = 4.56
REFERENCE_GEMM_TFLOPS = 812.0


@dataclass(frozen=True)
class Workload:
    name: str
    batch: int
    q_len: int
    kv_len: int  # KV tokens per request AFTER this step's write (the contract's kv_len)
    note: str = ""
    causal: bool = True

    @property
    def kind(self) -> str:
        """'memory' (decode-like: reported as TB/s of KV read) or 'compute' (TFLOP/s)."""
        return "memory" if self.q_len <= 16 else "compute"

    @property
    def metric(self) -> str:
        return "TB/s" if self.kind == "memory" else "TFLOP/s"

    @property
    def num_q_rows(self) -> int:
        return self.batch * self.q_len

    def pages_per_request(self, page_size: int) -> int:
        return -(-self.kv_len // page_size)

    def num_pages(self, page_size: int) -> int:
        return self.batch * self.pages_per_request(page_size)

    def kv_bytes(self) -> int:
        """K and V bytes the batch attends, counted once: B * kv_len * H_kv * D * 2 B * 2."""
        return self.batch * self.kv_len * H_KV * HEAD_DIM * DTYPE_BYTES * 2

    def qo_bytes(self) -> int:
        """q read once plus out written once."""
        return 2 * self.num_q_rows * H_Q * HEAD_DIM * DTYPE_BYTES

    def min_bytes(self) -> int:
        """The fewest bytes through device memory: KV once, q once, out once."""
        return self.kv_bytes() + self.qo_bytes()

    def visible_keys(self) -> int:
        """Sum over one request's queries of the keys each sees (causal counted exactly:
        query i sees kv_len - q_len + i + 1 keys)."""
        q, kv = self.q_len, self.kv_len
        if not self.causal:
            return q * kv
        return q * (kv - q) + q * (q + 1) // 2

    def flops(self) -> int:
        """4 * sum_b(H_q * D * visible keys): QK^T and PV, 2 flops per multiply-add each."""
        return 4 * self.batch * H_Q * HEAD_DIM * self.visible_keys()

    def floors_us(self, read_tbps: float = REFERENCE_READ_TBPS, gemm_tflops: float = REFERENCE_GEMM_TFLOPS):
        """(bytes floor, flops floor) in microseconds."""
        return self.min_bytes() / (read_tbps * 1e6), self.flops() / (gemm_tflops * 1e6)

    def figure(self, time_us: float) -> float:
        """The workload's throughput at time_us: TB/s of KV (memory) or TFLOP/s (compute)."""
        if self.kind == "memory":
            return self.kv_bytes() / (time_us * 1e6)
        return self.flops() / (time_us * 1e6)


WORKLOADS = [
    Workload("decode_b64_l4096", 64, 1, 4096),
    Workload("decode_b16_l32768", 16, 1, 32768),
    Workload("decode_b1_l131072", 1, 1, 131072),
    Workload("decode_b1_l4096", 1, 1, 4096, "latency: one request, per-step time"),
    Workload("decode_b32_l4096", 32, 1, 4096, "a mid batch: whole rows fold into 256 CTAs"),
    Workload("verify_q4_b64_l4096", 64, 4, 4096, "TARGET_VERIFY chain: 4 drafts, kv_len = L"),
    Workload("verify_q8_b64_l4096", 64, 8, 4096, "TARGET_VERIFY chain: 8 drafts, kv_len = L"),
    Workload("draft_extend_q4_b64_l4096", 64, 4, 4096 + 4,
             "DRAFT_EXTEND_V2: prefix L = 4096 plus 4 drafts, kv_len = L + 4 (partial last page)"),
    Workload("prefill_b4_l4096", 4, 4096, 4096),
    Workload("prefill_b2_l8192", 2, 8192, 8192),
    Workload("extend_b4_q1024_l16384", 4, 1024, 16384, "chunk of 1024 over a 15360-token prefix"),
]
BY_NAME = {w.name: w for w in WORKLOADS}


def select(patterns) -> list[Workload]:
    """Workloads whose name matches any pattern: exact, prefix ('decode'), or glob ('*_b64_*').
    No patterns: all of them, in the table's order."""
    if not patterns:
        return list(WORKLOADS)
    chosen = []
    for p in patterns:
        hits = [w for w in WORKLOADS if w.name == p or w.name.startswith(p) or fnmatch.fnmatchcase(w.name, p)]
        if not hits:
            raise ValueError(f"no workload matches {p!r}; known: {', '.join(BY_NAME)}")
        chosen += [w for w in hits if w not in chosen]
    return [w for w in WORKLOADS if w in chosen]


def num_sets(bytes_per_set: int, l2_bytes: int, launches: int) -> int:
    """Input sets to rotate so one graph of `launches` launches touches > 3x the L2
    (at least 2, so consecutive launches never share inputs; at most `launches`)."""
    need = math.ceil(3 * l2_bytes / max(1, bytes_per_set)) + 1
    return max(2, min(launches, need))


def check_windows(w: Workload) -> list[tuple[int, int, int]]:
    """(request, first row, end row) windows compared with the fp64 reference: the first
    and last request; all rows when q_len <= 128, else the first 32 and the last 64."""
    reqs = sorted({0, w.batch - 1})
    if w.q_len <= 128:
        rows = [(0, w.q_len)]
    else:
        rows = [(0, 32), (w.q_len - 64, w.q_len)]
    return [(b, r0, r1) for b in reqs for r0, r1 in rows]
