"""Adds the timeline stamps lab/probe_mla_timeline.py reads to a copy of the MLA seesaw kernel (lab;
never to the package): `mla_trace[cta][24]` with the CTA's start / done ns (globaltimer) and SM, and per
warpgroup (thread 0 of each) the clock64 cycles spent issuing S (its column blocks' mbarrier waits),
at the loop-top S wait, at the exchange barriers, in the P V products and in the fills, and cycles to
the first S, to the loop's end and to the end, and the prologue's steps from the CTA's start (18
barriers set, 19 query copies issued, 20 the first pair's copies issued, 21 the query block landed);
22 the CTA's first instruction and 23 its last warp's exit (ns, globaltimer).

    git archive HEAD cupy_fa kernels bench | tar -x -C exp/trace && python3 lab/mla_trace_stamp.py exp/trace
"""

import re
import sys

HELPERS = '''extern "C" {
__device__ unsigned long long mla_trace[8192][24];
}

namespace cupy_fa {
namespace mla {

__device__ __forceinline__ long long tclk() { return clock64(); }
__device__ __forceinline__ unsigned long long tns() {
  unsigned long long now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  return now;
}
__device__ __forceinline__ void tadd(int e, long long v) {
  if ((threadIdx.x & 127) == 0 && blockIdx.x < 8192) atomicAdd(&mla_trace[blockIdx.x][e], (unsigned long long)v);
}
__device__ __forceinline__ void tset(int e, unsigned long long v) {
  if (threadIdx.x == 0 && blockIdx.x < 8192) mla_trace[blockIdx.x][e] = v;
}

'''


def timed(s, pattern, entry):
    """Wraps every statement matching `pattern` (a regex of one line) in a clock64 sum into `entry`."""
    def wrap(m):
        indent, stmt = m.group(1), m.group(2)
        return (f"{indent}{{ const long long t_ = tclk();\n{indent}{stmt}\n"
                f"{indent}tadd({entry}, tclk() - t_); }}")
    s2, n = re.subn(r"^( *)(" + pattern + r")$", wrap, s, flags=re.M)
    if n == 0:
        raise SystemExit(f"no statement matches {pattern!r}")
    return s2


def main(tree):
    path = f"{tree}/kernels/mla/seesaw.cuh"
    s = open(path).read()
    s = s.replace("namespace cupy_fa {\nnamespace mla {\n\n", HELPERS, 1)
    # entries, warpgroup 0 from 3 and warpgroup 1 from 9: +0 S issue, +1 top S wait, +2 exchange barriers,
    # +3 P V products, +4 fills
    s = timed(s, r"issue_scores\(wg, i \+ 1\);", "3 + 6 * wg")
    s = re.sub(r"^( *)(const bool more = i \+ 1 < num_pairs;)\n( *)sm90::wgmma_wait<0>\(\);",
               r"\1\2\n\3const long long t_top = tclk();\n\3sm90::wgmma_wait<0>();\n\3tadd(4 + 6 * wg, tclk() - t_top);",
               s, count=1, flags=re.M)
    s = timed(s, r"sm90::named_sync\(kBarP[01](Read)?, 256\);.*", "5 + 6 * wg")
    s = timed(s, r"if \(wg == 1\) sm90::named_sync\(kBarP1Read, 256\);.*", "5 + 6 * wg")
    s = timed(s, r"pv\([01], wg, frag\);.*", "6 + 6 * wg")
    s = timed(s, r"(if \(more\) )?fill\([01], 2 \* i \+ [23], wg(, next)?\);.*", "7 + 6 * wg")
    open(path, "w").write(s)

    path = f"{tree}/kernels/mla/wgmma.cu"
    s = open(path).read()
    s = s.replace("  if (!find_work<kBlockRows>(p, by_head, blockIdx.x, w)) return;  // the whole CTA, before any barrier\n",
                  "  if (!find_work<kBlockRows>(p, by_head, blockIdx.x, w)) return;  // the whole CTA, before any barrier\n"
                  "  tset(0, tns());\n  const long long t_start = tclk();\n", 1)
    # the prologue, thread 0's cycles from the CTA's start at each step
    for pattern, entry in ((r"  __syncthreads\(\);\n(?=\n  SeesawRole<T> role)", 18),
                           (r"  mbar::cp_async_arrive_noinc\(base \+ SeesawSmem::kBars\);\n", 19),
                           (r"    for \(int b = 0; b < 2; \+\+b\) role\.fill\(b, b, wg, lookup_keys\(p, w, b, wtid\)\);\n  \}\n", 20),
                           (r"  mbar::wait\(base \+ SeesawSmem::kBars, 0\);\n", 21)):
        m = re.search(pattern, s)
        assert m, pattern
        stamp = f"  if (tid == 0) mla_trace[blockIdx.x][{entry}] = tclk() - t_start;\n"
        s = s[:m.end()] + stamp + s[m.end():]
    s, n = re.subn(r"^( *)role\.issue_scores\(wg, 0\);\n",
                   r"\1{ const long long t_ = tclk();\n\1role.issue_scores(wg, 0);\n\1tadd(3 + 6 * wg, tclk() - t_); }\n"
                   r"\1if (tid == 0) mla_trace[blockIdx.x][15] = tclk() - t_start;  // cycles to the first S issued\n",
                   s, count=1, flags=re.M)
    assert n == 1
    s, n = re.subn(r"^(  // the row's sum: )", "  if (tid == 0) mla_trace[blockIdx.x][14] = tclk() - t_start;\n\\1",
                   s, count=1, flags=re.M)
    assert n == 1
    s, n = re.subn(r"^(  role\.store_rows\(done, (partial_base_done, )?l, bad, wg\);.*)$",
                   "\\1\n  if (tid == 0) {\n    unsigned sm;\n    asm volatile(\"mov.u32 %0, %%smid;\" : \"=r\"(sm));\n"
                   "    mla_trace[blockIdx.x][2] = sm;\n    mla_trace[blockIdx.x][1] = tns();\n"
                   "    mla_trace[blockIdx.x][8] = tclk() - t_start;\n  }\n"
                   "  if ((tid & 31) == 0 && blockIdx.x < 8192) atomicMax(&mla_trace[blockIdx.x][23], tns());",
                   s, count=1, flags=re.M)
    assert n == 1
    # the CTA's first instruction (before find_work), ns: the work lookup and the launch gap apart
    s, n = re.subn(r"^(  allow_dependent_launch\(\);\n)",
                   "\\1  if (threadIdx.x == 0 && blockIdx.x < 8192) mla_trace[blockIdx.x][22] = tns();\n",
                   s, count=1, flags=re.M)
    assert n == 1
    open(path, "w").write(s)


if __name__ == "__main__":
    main(sys.argv[1])
