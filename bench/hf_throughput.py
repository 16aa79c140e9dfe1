"""transformers continuous batching, tokens/s: ``paged|cupy_fa`` vs ``paged|sdpa`` (and
``paged|flash_attention_2`` when flash-attn is installed), on a random model of
Llama-3.2-1B's shape built in code (no hub access).

    python -m bench.hf_throughput                 # 64 requests x 256 new tokens, 256-token prompts
    python -m bench.hf_throughput --requests 16 --new-tokens 64 --layers 4   # a quick look

Each implementation first runs a short warm-up batch (kernel compiles, allocator), then the
timed ``generate_batch``; tokens/s = requests x new tokens / wall time of that call. Every
implementation gets the same continuous-batching config (block size, cache blocks, token
budget), so they schedule the same batches. ``--summary FILE`` prints the lines the
transformers GPU test wrote (CUPY_FA_HF_SUMMARY) before the table.
"""

import argparse
import importlib.util
import json
import sys
import time


def llama_1b_config(layers):
    import transformers

    return transformers.LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                    num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                                    head_dim=64, max_position_embeddings=8192, rope_theta=500000.0,
                                    tie_word_embeddings=True)


def run(args):
    import torch
    import transformers

    import cupy_fa.integrations.transformers as hf

    hf.register()
    torch.manual_seed(args.seed)
    config = llama_1b_config(args.layers)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    params = sum(p.numel() for p in model.parameters()) / 1e9
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(1, config.vocab_size, (args.prompt_len,), generator=g).tolist()
               for _ in range(args.requests)]
    per_request = -(-(args.prompt_len + args.new_tokens) // args.block_size)
    implementations = ["paged|cupy_fa", "paged|sdpa"]
    if importlib.util.find_spec("flash_attn") is not None:
        implementations.append("paged|flash_attention_2")
    gen = transformers.GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None,
                                        pad_token_id=0)
    warm = transformers.GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)

    def cb_config():
        return transformers.ContinuousBatchingConfig(block_size=args.block_size,
                                                     num_blocks=args.requests * per_request + 16,
                                                     max_batch_tokens=args.max_batch_tokens,
                                                     allow_block_sharing=False)

    rows, tokens = [], {}
    for implementation in implementations:
        try:
            model.set_attn_implementation(implementation)
            model.generate_batch(prompts[:4], generation_config=warm, continuous_batching_config=cb_config())
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb_config())
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
        except Exception as exc:  # an implementation this machine lacks: say so, keep the others
            rows.append((implementation, None, f"failed: {type(exc).__name__}: {exc}"[:120]))
            print(f"{implementation}: {rows[-1][2]}", flush=True)
            continue
        results = list(out.values())
        generated = sum(len(r.generated_tokens) for r in results)
        errors = sum(r.error is not None for r in results)
        tokens[implementation] = [r.generated_tokens for r in results]
        note = f"{len(results)} requests, {generated} tokens" + (f", {errors} failed" if errors else "")
        rows.append((implementation, generated / seconds if not errors else None, f"{seconds:.2f} s, {note}"))
        print(f"{implementation}: {generated / seconds:.0f} tokens/s ({note}, {seconds:.2f} s)", flush=True)

    if args.summary:
        try:
            with open(args.summary) as f:
                lines = [json.loads(line)["line"] for line in f if line.strip()]
        except OSError:
            lines = [f"(no summary at {args.summary})"]
        print("\n== transformers GPU test (paged|cupy_fa vs paged|sdpa, cupy_fa vs sdpa)")
        for line in lines:
            print(line)
    print(f"\n== generate_batch throughput: random Llama-3.2-1B shape ({args.layers} layers, {params:.2f} B params, "
          f"32/8 heads, D 64, bf16), {args.requests} requests x {args.new_tokens} new tokens, "
          f"{args.prompt_len}-token prompts, block size {args.block_size}, {args.max_batch_tokens}-token batches")
    print(f"{'implementation':26s} {'tokens/s':>10s}  notes")
    for implementation, rate, note in rows:
        print(f"{implementation:26s} {'-' if rate is None else f'{rate:.0f}':>10s}  {note}")
    ref = tokens.get("paged|sdpa")
    if ref is not None and "paged|cupy_fa" in tokens:
        same = sum(a == b for a, b in zip(tokens["paged|cupy_fa"], ref))
        print(f"paged|cupy_fa requests with the same tokens as paged|sdpa: {same}/{len(ref)} "
              f"(random weights: near-ties may part; tests/test_hf_integration_gpu.py judges them)")
    return 0 if all(rate is not None for impl, rate, _ in rows if impl != "paged|flash_attention_2") else 1


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--layers", type=int, default=16, help="16 = Llama-3.2-1B")
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--max-batch-tokens", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--summary", default=None, help="a CUPY_FA_HF_SUMMARY file to print first")
    args = parser.parse_args(argv)
    from . import refuse_here

    if refuse_here("bench.hf_throughput", needs=("torch", "transformers")):
        return 1
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
