"""The benchmark workloads and what each must move and compute (pure Python, no GPU).

Every workload has H_q = 32 query heads and H_kv = 8 KV heads; bf16, head dim 128 and causal
masking (bottom-right aligned, docs/design.md "The contract") unless it says otherwise. Most give
every request of the batch the same q_len / kv_len; a ragged one lists its requests (``ragged``:
groups of (count, q_len, kv_len)). Each runs at page size 16 and page size 1 with a shuffled page
table.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass

H_Q, H_KV, HEAD_DIM = 32, 8, 128
DTYPE, DTYPE_BYTES = "bfloat16", 2
FP8 = "float8_e4m3fn"
FP8_SCALE = 6.0 / 448  # the fp8 cells' per-tensor scale: N(0, 1) values to 6 sigma at e4m3's 448
PAGE_SIZES = (16, 1)
SHORT_DTYPE = {"bfloat16": "bf16", "float16": "fp16"}

# The H200's ceilings as measured before v1 (docs/performance.md, "Floors"): used for the written floors and as fallbacks
# when a ceiling could not be measured in the run.
REFERENCE_READ_TBPS = 4.56
REFERENCE_GEMM_TFLOPS = 812.0


@dataclass(frozen=True)
class Workload:
    name: str
    batch: int
    q_len: int   # the longest request's (every request's, unless ragged)
    kv_len: int  # KV tokens per request AFTER this step's write (the contract's kv_len); the longest's if ragged
    note: str = ""
    causal: bool = True
    head_dim: int = HEAD_DIM
    dtype: str = DTYPE
    ragged: tuple = ()  # ((count, q_len, kv_len), ...) in batch order: requests of different lengths
    # the attention variants (cupy_fa plan / run): a sliding window of W keys (0: none), a logits
    # soft-cap (0: none), attention sinks (one random logit per query head)
    window: int = 0
    soft_cap: float = 0.0
    sinks: bool = False
    # an fp8 (e4m3) KV cache (kv_dtype "float8_e4m3fn"): the bf16 cache's values quantised with one
    # scale per tensor (the scale kind FlashInfer's paged wrappers take); "" = the 16-bit dtype's
    kv_dtype: str = ""
    # V's and out's head dim where it differs from q's and K's (separate qk / vo head dims); 0: head_dim
    head_dim_vo: int = 0

    @property
    def dim_vo(self) -> int:
        """V's and out's head dim (head_dim unless head_dim_vo is set)."""
        return self.head_dim_vo or self.head_dim

    def __post_init__(self):
        if self.ragged:
            if sum(n for n, _, _ in self.ragged) != self.batch:
                raise ValueError(f"{self.name}: the ragged groups hold {sum(n for n, _, _ in self.ragged)} requests, "
                                 f"batch is {self.batch}")
            if (max(q for _, q, _ in self.ragged), max(kv for _, _, kv in self.ragged)) != (self.q_len, self.kv_len):
                raise ValueError(f"{self.name}: q_len / kv_len must be the longest request's")

    def requests(self) -> list[tuple[int, int]]:
        """(q_len, kv_len) of every request, in batch order."""
        if not self.ragged:
            return [(self.q_len, self.kv_len)] * self.batch
        return [(q, kv) for n, q, kv in self.ragged for _ in range(n)]

    @property
    def q_lens(self) -> list[int]:
        return [q for q, _ in self.requests()]

    @property
    def kv_lens(self) -> list[int]:
        return [kv for _, kv in self.requests()]

    @property
    def uniform(self) -> bool:
        """Every request has the same lengths (what dense SDPA can run in one call)."""
        return not self.ragged

    @property
    def kind(self) -> str:
        """'memory' (decode-like: reported as TB/s of KV read), 'compute' (TFLOP/s), or 'mixed'
        (small-q and long requests in one batch, each bound by its own resource: reported in us)."""
        if self.q_len <= 16:
            return "memory"
        return "mixed" if min(self.q_lens) <= 16 else "compute"

    @property
    def metric(self) -> str:
        return {"memory": "TB/s", "compute": "TFLOP/s", "mixed": "us"}[self.kind]

    @property
    def elem_bytes(self) -> int:
        """Bytes of a K / V element: 1 over an fp8 cache, else 2 (bf16, fp16)."""
        return 1 if self.fp8 else 2

    @property
    def fp8(self) -> bool:
        return self.kv_dtype == FP8

    @property
    def shape(self) -> str:
        """'bf16 D128 causal' and the like: what the table's rows differ in besides the lengths."""
        dims = f"D{self.head_dim}" + (f"/{self.dim_vo}" if self.dim_vo != self.head_dim else "")
        return (f"{SHORT_DTYPE[self.dtype]}{' fp8kv' if self.fp8 else ''} {dims} "
                f"{'causal' if self.causal else 'full'}" + self.variant)

    @property
    def variant(self) -> str:
        """' w4096', ' cap30', ' sinks' (each the workload has), or ''."""
        return ((f" w{self.window}" if self.window else "") + (f" cap{self.soft_cap:g}" if self.soft_cap else "")
                + (" sinks" if self.sinks else ""))

    def window_keys(self, q: int, kv: int) -> int:
        """Keys the queries of a request of (q, kv) see at all: all kv, or with a window of W only
        the last W + q - 1 (causal: query i sees kv - q + i - W + 1 .. kv - q + i)."""
        return min(kv, self.window + q - 1) if self.window else kv

    @property
    def num_q_rows(self) -> int:
        return sum(self.q_lens)

    def pages_per_request(self, page_size: int) -> int:
        """Pages of the longest request (the page table's width)."""
        return -(-self.kv_len // page_size)

    def pages_of(self, page_size: int) -> list[int]:
        return [-(-kv // page_size) for kv in self.kv_lens]

    def num_pages(self, page_size: int) -> int:
        return sum(self.pages_of(page_size))

    def kv_bytes(self) -> int:
        """K and V bytes the batch attends, counted once: sum_b kv_len * H_kv * D * 2 B * 2 (with a
        window only the keys inside some query's window: window_keys)."""
        keys = sum(self.window_keys(q, kv) for q, kv in self.requests())
        return keys * H_KV * (self.head_dim + self.dim_vo) * self.elem_bytes

    def qo_bytes(self) -> int:
        """q read once plus out written once (16-bit both)."""
        return self.num_q_rows * H_Q * (self.head_dim + self.dim_vo) * 2

    def min_bytes(self) -> int:
        """The fewest bytes through device memory: KV once, q once, out once."""
        return self.kv_bytes() + self.qo_bytes()

    def visible_keys(self) -> int:
        """Sum over the batch's queries of the keys each sees (causal counted exactly: query i of
        a request sees kv_len - q_len + i + 1 keys). Per request for a uniform batch."""
        def of(q, kv):
            if self.window:  # query i sees min(W, its causal keys) (or, full, min(W + keys after it, kv))
                prefix = kv - q
                return sum(min(self.window, prefix + i + 1) if self.causal else
                           min(kv, kv - max(0, prefix + i - self.window + 1)) for i in range(q))
            return q * kv if not self.causal else q * (kv - q) + q * (q + 1) // 2

        if not self.ragged:
            return of(self.q_len, self.kv_len)
        return sum(n * of(q, kv) for n, q, kv in self.ragged)

    def flops(self) -> int:
        """2 * H_q * (D_qk + D_vo) * sum_b(visible keys of b): QK^T and PV, 2 flops per multiply-add
        each (4 * H_q * D where the head dims are one)."""
        per = self.visible_keys()
        return 2 * H_Q * (self.head_dim + self.dim_vo) * (per * self.batch if not self.ragged else per)

    def floors_us(self, read_tbps: float = REFERENCE_READ_TBPS, gemm_tflops: float = REFERENCE_GEMM_TFLOPS):
        """(bytes floor, flops floor) in microseconds."""
        return self.min_bytes() / (read_tbps * 1e6), self.flops() / (gemm_tflops * 1e6)

    def figure(self, time_us: float) -> float:
        """The workload's figure at time_us: TB/s of KV (memory), TFLOP/s (compute), the time
        itself (mixed)."""
        if self.kind == "memory":
            return self.kv_bytes() / (time_us * 1e6)
        if self.kind == "mixed":
            return time_us
        return self.flops() / (time_us * 1e6)

    def floor_fraction(self, time_us: float, read_tbps: float, gemm_tflops: float) -> float:
        """The larger floor (bytes or flops, floors_us) over time_us: how close to its bound."""
        return max(self.floors_us(read_tbps, gemm_tflops)) / time_us


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
    Workload("prefill_b2_l8192_d64", 2, 8192, 8192, "head dim 64", head_dim=64),
    Workload("prefill_b2_l8192_d256", 2, 8192, 8192, "head dim 256", head_dim=256),
    Workload("prefill_b2_l8192_full", 2, 8192, 8192, "non-causal: every query sees every key", causal=False),
    Workload("prefill_b2_l8192_fp16", 2, 8192, 8192, "fp16", dtype="float16"),
    Workload("extend_b8_q512_l8192", 8, 512, 8192, "long-prefix extend: a chunk of 512 over a 7680-token prefix"),
    Workload("mixed_q2048_d63_l4096", 64, 2048, 4096,
             "MIXED: one 2048-token chunk (over a 2048-token prefix) and 63 decode rows, all at kv_len 4096",
             ragged=((1, 2048, 4096), (63, 1, 4096))),
    # the attention variants: a window of 1024 (Mistral-like; a quarter of L), Gemma 2's
    # soft-cap of 50, gpt-oss's sinks; and a window of 4096 over 131072 keys, whose read is the window's
    Workload("decode_b64_l4096_w1024", 64, 1, 4096, "sliding window of 1024 keys", window=1024),
    Workload("decode_b64_l4096_cap50", 64, 1, 4096, "logits soft-cap 50", soft_cap=50.0),
    Workload("decode_b64_l4096_sinks", 64, 1, 4096, "attention sinks", sinks=True),
    Workload("prefill_b4_l4096_w1024", 4, 4096, 4096, "sliding window of 1024 keys", window=1024),
    Workload("prefill_b4_l4096_cap50", 4, 4096, 4096, "logits soft-cap 50", soft_cap=50.0),
    Workload("prefill_b4_l4096_sinks", 4, 4096, 4096, "attention sinks", sinks=True),
    Workload("decode_b1_l131072_w4096", 1, 1, 131072, "window of 4096 over 131072 keys: it reads the window",
             window=4096),
    Workload("decode_b64_l4096_d96", 64, 1, 4096, "head dim 96", head_dim=96),
    Workload("decode_b64_l4096_d192", 64, 1, 4096, "head dim 192", head_dim=192),
    Workload("prefill_b4_l4096_d96", 4, 4096, 4096, "head dim 96", head_dim=96),
    Workload("prefill_b4_l4096_d192", 4, 4096, 4096, "head dim 192", head_dim=192),
    Workload("prefill_b4_l4096_qk192_vo128", 4, 4096, 4096, "qk / vo head dims 192 / 128 (sm_90a: the wgmma tile of the pair)",
             head_dim=192, head_dim_vo=128),
    # an fp8 KV cache: the prefill and extend cells over it (ours: the wgmma fp8 tile on sm_90a)
    Workload("prefill_b4_l4096_fp8", 4, 4096, 4096, "fp8 KV cache (per-tensor scales)", kv_dtype=FP8),
    Workload("prefill_b2_l8192_fp8", 2, 8192, 8192, "fp8 KV cache (per-tensor scales)", kv_dtype=FP8),
    Workload("extend_b4_q1024_l16384_fp8", 4, 1024, 16384, "fp8 KV cache: a chunk of 1024 over 15360 keys",
             kv_dtype=FP8),
]
BY_NAME = {w.name: w for w in WORKLOADS}


def select(patterns) -> list[Workload]:
    """Workloads whose name matches any pattern: exact (that one alone, though others start with
    it), prefix ('decode'), or glob ('*_b64_*'), in the order the patterns are given (a pattern's
    matches in the table's order), so a run cut short by ``--budget`` has run the first ones. No
    patterns: all of them, in the table's order."""
    if not patterns:
        return list(WORKLOADS)
    chosen = []
    for p in patterns:
        hits = [BY_NAME[p]] if p in BY_NAME else \
            [w for w in WORKLOADS if w.name.startswith(p) or fnmatch.fnmatchcase(w.name, p)]
        if not hits:
            raise ValueError(f"no workload matches {p!r}; known: {', '.join(BY_NAME)}")
        chosen += [w for w in hits if w not in chosen]
    return chosen


def num_sets(bytes_per_set: int, l2_bytes: int, launches: int) -> int:
    """Input sets to rotate so one graph of `launches` launches touches > 3x the L2
    (at least 2, so consecutive launches never share inputs; at most `launches`)."""
    need = math.ceil(3 * l2_bytes / max(1, bytes_per_set)) + 1
    return max(2, min(launches, need))


def check_windows(w: Workload) -> list[tuple[int, int, int]]:
    """(request, first row, end row) windows compared with the fp64 reference: the first and
    last request (and a ragged batch's first of each group); all rows of a request of up to 128
    rows, else its first 32 and last 64."""
    q_lens = w.q_lens
    reqs = {0, w.batch - 1}
    if w.ragged:
        starts = [0]
        for n, _, _ in w.ragged[:-1]:
            starts.append(starts[-1] + n)
        reqs |= set(starts)
    windows = []
    for b in sorted(reqs):
        q = q_lens[b]
        rows = [(0, q)] if q <= 128 else [(0, 32), (q - 64, q)]
        windows += [(b, r0, r1) for r0, r1 in rows]
    return windows
