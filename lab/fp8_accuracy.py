"""Which products an fp8 cache's prefill runs in, by their error against float64 (CPU only, a lab probe).

Over the dequantised cache (e4m3 bytes x the scales: what the kernels are held to), causal
attention of bf16 queries is emulated in float64 with the roundings of two designs:

* fp16 products (what the wgmma family ships, and the mma.sync family): K / V widened exactly to
  fp16, Q rewritten per row as fp16 x 2^e (exact), S in fp32 (here exact), P rounded to fp16, the
  output rounded to bf16;
* fp8 products (FlashAttention-3's fp8 path): Q quantised to e4m3 with a scale per (token, head)
  row (amax / 448, the best a per-row scale does), P quantised to e4m3 after scaling the row's
  weights (at most 1) by 256, the output rounded to bf16;
* fp8 Q K^T with split queries, fp16 P V (2026-12-06: K read as e4m3 by the tensor cores, only V
  widened): Q = hi + lo, hi Q's e4m3 rounding at a per-row scale (amax / 448) and lo the e4m3
  rounding of what hi missed (its own per-row scale), S = hi K^T + lo K^T (two fp8 products, fp32
  sums: exact here), P in fp16 over V widened exactly, the output rounded to bf16; the same with lo
  at hi's scale (so one accumulator and one scale a row take both products); three terms at that
  one scale (hi + lo + what lo missed); and with Q in one e4m3 term (hi alone), to see what the
  second term buys.

Prints each design's relative error ||out - ref|| / ||ref|| and the largest per-row one, over
random N(0, 1) data at D = 128 (bf16's bar is 1e-2).

    python3 lab/fp8_accuracy.py [--keys 2048] [--heads 4]
"""

import argparse

import ml_dtypes
import numpy as np

from cupy_fa.reference import dequantize_e4m3, quantize_e4m3


def rounded(x, dtype):
    return np.asarray(x, np.float64).astype(dtype).astype(np.float64)


def attention(q, k, v, p_round, scale):
    s = (q @ k.T) * scale
    n = s.shape[0]
    s[np.triu_indices(n, 1)] = -np.inf  # causal, q_len == kv_len
    m = s.max(axis=1, keepdims=True)
    p = np.exp(s - m)
    l = p.sum(axis=1, keepdims=True)
    return (p_round(p) @ v) / l


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--queries", choices=("bf16", "fp16"), default="bf16", help="the queries' and output's type")
    parser.add_argument("--sharpness", type=float, default=1.0, help="queries drawn N(0, sharpness^2): peakier rows")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    n, d = args.keys, args.dim
    scale = 1 / np.sqrt(d)
    kv_scale = 6.0 / 448
    names = ("fp16 products", "fp8 products", "fp8 QK, split Q", "split, one scale", "three, one scale",
             "fp8 QK, one Q")
    errs, rows = {n: [] for n in names}, {n: [] for n in names}
    qtype = ml_dtypes.bfloat16 if args.queries == "bf16" else np.float16
    for _ in range(args.heads):
        q = rounded(args.sharpness * rng.standard_normal((n, d)), qtype)
        k = dequantize_e4m3(quantize_e4m3(rng.standard_normal((n, 1, d)).astype(np.float32), kv_scale), kv_scale)[:, 0]
        v = dequantize_e4m3(quantize_e4m3(rng.standard_normal((n, 1, d)).astype(np.float32), kv_scale), kv_scale)[:, 0]
        ref = attention(q, k, v, lambda p: p, scale)
        # fp16 products: Q exact in fp16 (times 2^e per row), P in fp16
        out16 = rounded(attention(q, k, v, lambda p: rounded(p, np.float16), scale), qtype)
        # fp8 products: Q per row to e4m3 (amax / 448), P x 256 to e4m3
        q_scale = np.abs(q).max(axis=1, keepdims=True) / 448
        q8 = dequantize_e4m3(quantize_e4m3((q / q_scale)[:, None, :].astype(np.float32), 1.0), 1.0)[:, 0] * q_scale

        def p8(p):
            return dequantize_e4m3(quantize_e4m3((p * 256)[:, None, :].astype(np.float32), 1.0), 1.0)[:, 0] / 256

        out8 = rounded(attention(q8, k, v, p8, scale), qtype)
        # fp8 Q K^T with Q = hi + lo (each e4m3 at its own per-row scale), P V in fp16
        lo_scale = np.maximum(np.abs(q - q8).max(axis=1, keepdims=True), 1e-30) / 448
        lo = dequantize_e4m3(quantize_e4m3(((q - q8) / lo_scale)[:, None, :].astype(np.float32), 1.0), 1.0)[:, 0] \
            * lo_scale
        p16 = lambda p: rounded(p, np.float16)  # noqa: E731
        split = rounded(attention(q8 + lo, k, v, p16, scale), qtype)
        lo1 = dequantize_e4m3(quantize_e4m3(((q - q8) / q_scale)[:, None, :].astype(np.float32), 1.0), 1.0)[:, 0] \
            * q_scale
        shared = rounded(attention(q8 + lo1, k, v, p16, scale), qtype)
        rest = q - q8 - lo1
        lo2 = dequantize_e4m3(quantize_e4m3((rest / q_scale)[:, None, :].astype(np.float32), 1.0), 1.0)[:, 0] * q_scale
        three = rounded(attention(q8 + lo1 + lo2, k, v, p16, scale), qtype)
        one = rounded(attention(q8, k, v, p16, scale), qtype)
        for name, out in zip(names, (out16, out8, split, shared, three, one)):
            errs[name].append(np.linalg.norm(out - ref) / np.linalg.norm(ref))
            rows[name].append(np.max(np.linalg.norm(out - ref, axis=1) / np.linalg.norm(ref, axis=1)))
    print(f"causal prefill of {n} tokens, D {d}, {args.queries} queries (x {args.sharpness:g}) over an fp8 cache (per-tensor scale {kv_scale:.4f}), "
          f"{args.heads} heads, against float64 on the dequantised cache:")
    for name in errs:
        print(f"  {name:16s} rel err {np.mean(errs[name]):.2e} (max over heads {np.max(errs[name]):.2e}), "
              f"worst row {np.max(rows[name]):.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
