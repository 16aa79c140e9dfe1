"""transformers on the GPU through cupy_fa (markers gpu, torch): generate_batch with
"paged|cupy_fa" gives the tokens of "paged|sdpa" for every request over 64 new tokens, and
generate with "cupy_fa" those of "sdpa", on tiny random bf16 Llama and Qwen2-style models
(GQA, head dims 64 and 128) built in code; where a token differs, the logits at the first
difference must agree within bf16 tolerance and the two tokens be a tie (tests/hf_compare.py;
every margin is printed). CUPY_FA_HF_SUMMARY=path appends one line per case to that file."""

import json
import os

import pytest

import hf_compare as C

pytestmark = [pytest.mark.gpu, pytest.mark.torch]

CASES = {  # name: (kind, head_dim, query heads, KV heads, block size)
    "llama-d64-h16-kv4-block256": ("llama", 64, 16, 4, 256),
    "qwen2-d128-h8-kv2-block32": ("qwen2", 128, 8, 2, 32),
}
NEW_TOKENS = 64
PROMPT_LENGTHS = (1, 7, 64, 129, 300, 33, 256, 500, 17, 90)  # 300 and 500 prefill in chunks of 256


def _setup():
    import torch
    import transformers

    import cupy_fa.integrations.transformers as hf

    hf.register()
    return torch, transformers, hf


def _count_kernel_calls(monkeypatch, hf):
    calls = {"attention": 0}
    real = hf.backend.attention

    def counted(*args, **kwargs):
        calls["attention"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(hf.backend, "attention", counted)
    return calls


def _model(case, seed):
    torch, _, _ = _setup()
    kind, head_dim, heads, kv_heads, _ = CASES[case]
    config = C.tiny_config(kind, head_dim, heads, kv_heads)
    return C.build_model(config, "cuda", torch.bfloat16, seed), config


def _report(case, what, verdicts):
    equal, tie, logits = C.summary(verdicts)
    for v in verdicts:
        print(v.line())
    line = (f"{what:14s} {case:28s} requests {len(verdicts):2d}, equal {equal:2d}, worst tie margin {tie:.1e}, "
            f"worst logits diff {logits:.1e}, {'PASS' if all(v.ok for v in verdicts) else 'FAIL'}")
    print(line)
    path = os.environ.get("CUPY_FA_HF_SUMMARY")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"case": case, "what": what, "line": line}) + "\n")


def _generate_batch(model, transformers, prompts, block_size, implementation, **cb_options):
    blocks = sum(-(-(len(p) + NEW_TOKENS) // block_size) for p in prompts)
    cb = transformers.ContinuousBatchingConfig(block_size=block_size, num_blocks=2 * blocks + 8,
                                               max_batch_tokens=256, **cb_options)
    gen = transformers.GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                        pad_token_id=0)
    model.set_attn_implementation(implementation)
    out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
    results = list(out.values())
    assert len(results) == len(prompts), f"{implementation}: {len(results)} of {len(prompts)} requests came back"
    assert [r.error for r in results] == [None] * len(prompts), [r.error for r in results]
    tokens = [r.generated_tokens for r in results]
    assert all(len(t) == NEW_TOKENS for t in tokens), [len(t) for t in tokens]
    return tokens


@pytest.mark.parametrize("case", list(CASES))
def test_generate_batch_matches_paged_sdpa(case, monkeypatch):
    torch, transformers, hf = _setup()
    model, config = _model(case, seed=11)
    block_size = CASES[case][4]
    prompts = C.random_prompts(12, PROMPT_LENGTHS, config.vocab_size)
    theirs = _generate_batch(model, transformers, prompts, block_size, "paged|sdpa")
    calls = _count_kernel_calls(monkeypatch, hf)
    ours = _generate_batch(model, transformers, prompts, block_size, "paged|cupy_fa")
    assert calls["attention"] >= NEW_TOKENS * config.num_hidden_layers, calls  # the kernels ran, every layer
    verdicts = C.judge(model, prompts, ours, theirs, "cupy_fa", "sdpa")
    _report(case, "generate_batch", verdicts)
    assert all(v.ok for v in verdicts)


def test_generate_batch_under_cuda_graphs_matches_paged_sdpa(monkeypatch):
    """transformers' CUDA-graph path: padded steps (q_len = 0 requests, padding rows), the
    plan and the writes captured inside torch.cuda.graph and replayed."""
    case = "llama-d64-h16-kv4-block256"
    torch, transformers, hf = _setup()
    model, config = _model(case, seed=11)
    prompts = C.random_prompts(12, PROMPT_LENGTHS, config.vocab_size)
    theirs = _generate_batch(model, transformers, prompts, 256, "paged|sdpa")
    ours = _generate_batch(model, transformers, prompts, 256, "paged|cupy_fa", use_cuda_graph=True)
    verdicts = C.judge(model, prompts, ours, theirs, "cupy_fa", "sdpa")
    _report(case, "graphs", verdicts)
    assert all(v.ok for v in verdicts)


@pytest.mark.parametrize("case", list(CASES))
def test_generate_matches_sdpa(case, monkeypatch):
    """Plain generate, a left-padded batch (the padding mask reaches the kernel as lengths)."""
    torch, transformers, hf = _setup()
    model, config = _model(case, seed=13)
    prompts = C.random_prompts(14, PROMPT_LENGTHS[:7], config.vocab_size)
    longest = max(map(len, prompts))
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts], device="cuda")
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device="cuda")
    gen = transformers.GenerationConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                        eos_token_id=None, pad_token_id=0)
    runs = {}
    for implementation in ("sdpa", "cupy_fa"):
        if implementation == "cupy_fa":
            calls = _count_kernel_calls(monkeypatch, hf)
        model.set_attn_implementation(implementation)
        with torch.no_grad():
            runs[implementation] = model.generate(ids, attention_mask=mask, generation_config=gen)[:, longest:].tolist()
    assert calls["attention"] == NEW_TOKENS * config.num_hidden_layers
    verdicts = C.judge(model, prompts, runs["cupy_fa"], runs["sdpa"], "cupy_fa", "sdpa")
    _report(case, "generate", verdicts)
    assert all(v.ok for v in verdicts)
