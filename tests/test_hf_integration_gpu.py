"""transformers on the GPU through cupy_fa (markers gpu, torch), on tiny random bf16 Llama and
Qwen2-style models built in code (GQA, head dims 64 and 128): generate_batch with
"paged|cupy_fa" against transformers' "paged|sdpa" (eager, then under CUDA graphs), generate
with "cupy_fa" against "sdpa".

Each run is judged twice (tests/hf_compare.py says how and why): every attention call is
checked against the float64 reference over the keys transformers names (the hard evidence that
the mapping is right), and the tokens: equal to theirs over 64 new tokens, or, where a request
parts, our logits at the first difference within bf16 tolerance of a float32 copy of the model
and the two tokens a near tie of it (every margin printed). A deliberately wrong mapping must
fail both. One line per case at the end of each test (CUPY_FA_HF_SUMMARY=path also appends it
to that file as JSON)."""

import functools
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
EAGER = {"use_cuda_graph": False, "use_async_batching": False}
# the wrong mappings run short: 16 tokens of 5 requests (2..5 pages of 32), 64-token batches
MUTATION_CASE, MUTATION_LENGTHS, MUTATION_TOKENS, MUTATION_BATCH = "qwen2-d128-h8-kv2-block32", (5, 40, 70, 130), 16, 64


@functools.lru_cache(maxsize=None)
def _imports():
    """torch, transformers and the integration, registered once (a later register() would
    overwrite the audited functions a test put in its place)."""
    import torch
    import transformers

    import cupy_fa.integrations.transformers as hf

    hf.register()
    return torch, transformers, hf


class _Case:
    """One model per case (built once per run of this file), its float32 twin, and
    transformers' own runs (kept: several tests compare with them)."""

    def __init__(self, name):
        torch, _, _ = _imports()
        kind, head_dim, heads, kv_heads, self.block_size = CASES[name]
        self.name = name
        self.config = C.tiny_config(kind, head_dim, heads, kv_heads)
        self.model = C.build_model(self.config, "cuda", torch.bfloat16, seed=11)
        self.twin = C.Float32Twin(self.model)
        self.prompts = C.random_prompts(12, PROMPT_LENGTHS, self.config.vocab_size)
        self._theirs = {}

    def generate_batch(self, prompts, implementation, new_tokens=NEW_TOKENS, max_batch_tokens=256, audit=None,
                       mutation=None, **cb_options):
        """(tokens per request, logits lookup, probe)."""
        _, transformers, hf = _imports()
        with pytest.MonkeyPatch.context() as mp:
            if mutation is not None:
                C.mutate(mp, hf, mutation)
            probe = C.BatchProbe(self.config.num_hidden_layers, audit).install(
                mp, implementation, hf.paged_attention_forward if audit is not None else None)
            blocks = sum(-(-(len(p) + new_tokens) // self.block_size) for p in prompts)
            cb = transformers.ContinuousBatchingConfig(block_size=self.block_size, num_blocks=2 * blocks + 8,
                                                       max_batch_tokens=max_batch_tokens, **cb_options)
            gen = transformers.GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                                pad_token_id=0)
            self.model.set_attn_implementation(implementation)
            out = self.model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb,
                                            progress_bar=False)
        results = list(out.values())
        assert len(results) == len(prompts), f"{implementation}: {len(results)} of {len(prompts)} requests came back"
        assert [r.error for r in results] == [None] * len(prompts), [r.error for r in results]
        tokens = [r.generated_tokens for r in results]
        assert all(len(t) == new_tokens for t in tokens), [len(t) for t in tokens]
        return tokens, probe.lookup(list(out.keys()), prompts), probe

    def generate(self, prompts, implementation, new_tokens):
        """Plain generate of a left-padded batch: (tokens per request, logits lookup)."""
        torch, transformers, _ = _imports()
        longest = max(map(len, prompts))
        ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts], device=self.model.device)
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=self.model.device)
        gen = transformers.GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                            pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        self.model.set_attn_implementation(implementation)
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=mask, generation_config=gen)
        logits = torch.stack(out.logits, 1).float().cpu()  # [B, new tokens, V]
        return out.sequences[:, longest:].tolist(), lambda r, i: logits[r, i]

    def theirs(self, prompts, key, **options):
        """transformers' own paged|sdpa (eager: it needs its attention mask), run once per key."""
        if key not in self._theirs:
            tokens, logits, probe = self.generate_batch(prompts, "paged|sdpa", **options, **EAGER)
            assert not probe.failures, probe.failures[:5]
            self._theirs[key] = (tokens, logits)
        return self._theirs[key]


@pytest.fixture(scope="module")
def cases():
    made = {}

    def get(name):
        if name not in made:
            made[name] = _Case(name)
        return made[name]

    return get


def _conclude(what, case, prompts, ours, theirs, audit, needed, problems=(), extra=""):
    """Prints the judgement and the case's line, appends it to CUPY_FA_HF_SUMMARY, asserts."""
    (ours_tokens, ours_logits), (theirs_tokens, theirs_logits) = ours, theirs
    problems = list(problems) + C.logits_match_tokens(ours_tokens, ours_logits, "ours") + \
        C.logits_match_tokens(theirs_tokens, theirs_logits, "theirs")
    missing = sorted(k for k in needed if not audit.kinds.get(k))
    if missing:
        problems.append(f"the audit saw no {', '.join(missing)} call: it did not check what this test claims")
    judgement = C.judge(prompts, ours_tokens, theirs_tokens, ours_logits, theirs_logits, case.twin)
    ok = audit.ok and judgement.ok and not problems
    print(judgement.report())
    print(audit.report())
    for line in problems[:10]:
        print(line)
    line = f"{what} {case.name} {'PASS' if ok else 'FAIL'} | {audit.summary()} | {judgement.line()}{extra}"
    print(line)
    path = os.environ.get("CUPY_FA_HF_SUMMARY")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"case": case.name, "what": what, "line": line}) + "\n")
    assert ok, "\n".join([line] + audit.failures[:10] + problems[:10])


@pytest.mark.parametrize("name", list(CASES))
def test_generate_batch_matches_paged_sdpa(name, cases):
    """Eager continuous batching: fresh and chunked prefill (300 and 500 tokens in 256-token
    batches), mixed and decode steps, a request sharing blocks of another's prompt."""
    case = cases(name)
    audit = C.AttentionAudit(f"{name} ours")
    tokens, logits, probe = case.generate_batch(case.prompts, "paged|cupy_fa", audit=audit, **EAGER)
    theirs = case.theirs(case.prompts, "main")
    problems = probe.failures + ([] if set(probe.steps) == {"eager"} else [f"steps not all eager: {probe.steps}"])
    _conclude("generate_batch", case, case.prompts, (tokens, logits), theirs, audit,
              {"prefill", "chunked prefill", "mixed", "decode"}, problems)


def test_generate_batch_under_cuda_graphs_matches_paged_sdpa(cases):
    """transformers' CUDA-graph path (its warmup captures first, async batching as it decides):
    padded steps (q_len = 0 requests, padding rows), the plan and the K/V writes captured in
    torch.cuda.graph and replayed; every replay audited through the tensors its capture saw."""
    case = cases("llama-d64-h16-kv4-block256")
    audit = C.AttentionAudit(f"{case.name} ours, graphs")
    tokens, logits, probe = case.generate_batch(case.prompts, "paged|cupy_fa", audit=audit, use_cuda_graph=True)
    theirs = case.theirs(case.prompts, "main")
    problems = list(probe.failures)
    if not probe.steps.get("replayed") or not probe.steps.get("captured"):
        problems.append(f"no CUDA graph was both captured and replayed: steps {dict(probe.steps)}")
    _conclude("graphs", case, case.prompts, (tokens, logits), theirs, audit, {"padded", "chunked prefill", "decode"},
              problems, extra=f" | steps {dict(sorted(probe.steps.items()))}")


def _audit_dense(monkeypatch, prompts, label):
    """Every call of "cupy_fa" checked (the test knows each row's left padding)."""
    _, transformers, hf = _imports()
    audit = C.AttentionAudit(label)
    longest = max(map(len, prompts))
    monkeypatch.setitem(transformers.AttentionInterface._global_mapping, hf.ATTENTION,
                        C.audited_dense(audit, hf.attention_forward, [longest - len(p) for p in prompts]))
    return audit


@pytest.mark.parametrize("name", list(CASES))
def test_generate_matches_sdpa(name, cases, monkeypatch):
    """Plain generate, a left-padded batch (the padding mask reaches the kernel as lengths)."""
    case = cases(name)
    prompts = C.random_prompts(14, PROMPT_LENGTHS[:7], case.config.vocab_size)
    audit = _audit_dense(monkeypatch, prompts, f"{name} ours")
    theirs = case.generate(prompts, "sdpa", NEW_TOKENS)
    ours = case.generate(prompts, "cupy_fa", NEW_TOKENS)
    problems = []
    if audit.calls != NEW_TOKENS * case.config.num_hidden_layers:
        problems.append(f"{audit.calls} attention calls audited, expected {NEW_TOKENS} x "
                        f"{case.config.num_hidden_layers} layers")
    _conclude("generate", case, prompts, ours, theirs, audit, {"prefill", "decode", "padded"}, problems)


@pytest.mark.parametrize("mutation", list(C.MUTATIONS))
def test_a_wrong_mapping_fails_both_judges(mutation, cases):
    """The instruments can fail: the mapping made wrong on purpose (a kv_len one short, a
    request's second page reading its first), continuous batching with chunked prefill, must
    be FAIL for the attention audit and for the token judge."""
    case = cases(MUTATION_CASE)
    prompts = C.random_prompts(21, MUTATION_LENGTHS, case.config.vocab_size)
    options = dict(new_tokens=MUTATION_TOKENS, max_batch_tokens=MUTATION_BATCH)
    audit = C.AttentionAudit(f"{case.name} ours, {mutation}")
    tokens, logits, probe = case.generate_batch(prompts, "paged|cupy_fa", audit=audit, mutation=mutation,
                                                   **options, **EAGER)
    theirs_tokens, theirs_logits = case.theirs(prompts, "mutation", **options)
    judgement = C.judge(prompts, tokens, theirs_tokens, logits, theirs_logits, case.twin)
    assert not probe.failures, probe.failures[:5]
    _mutation_verdict("generate_batch", mutation, case, audit, judgement)


def test_a_wrong_dense_mapping_fails_both_judges(cases, monkeypatch):
    """The same for generate's mapping: a kv_len one short (each decode query misses its own key)."""
    _, _, hf = _imports()
    case = cases(MUTATION_CASE)
    prompts = C.random_prompts(22, MUTATION_LENGTHS, case.config.vocab_size)
    theirs_tokens, theirs_logits = case.generate(prompts, "sdpa", MUTATION_TOKENS)
    audit = _audit_dense(monkeypatch, prompts, f"{case.name} ours, kv_len - 1")
    C.mutate(monkeypatch, hf, "kv_len - 1")
    tokens, logits = case.generate(prompts, "cupy_fa", MUTATION_TOKENS)
    judgement = C.judge(prompts, tokens, theirs_tokens, logits, theirs_logits, case.twin)
    _mutation_verdict("generate", "kv_len - 1", case, audit, judgement)


def _mutation_verdict(what, mutation, case, audit, judgement):
    print(audit.report(6))
    print(judgement.report())
    line = (f"mutation {mutation!r} ({what}) {case.name}: {'PASS' if not audit.ok and not judgement.ok else 'FAIL'} "
            f"| audit {'caught it' if not audit.ok else 'MISSED it'}: {audit.summary()} | token judge "
            f"{'caught it' if not judgement.ok else 'MISSED it'}: {judgement.line()}")
    print(line)
    path = os.environ.get("CUPY_FA_HF_SUMMARY")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"case": case.name, "what": f"mutation {mutation} ({what})", "line": line}) + "\n")
    assert not audit.ok, f"the attention audit missed a wrong mapping ({mutation}, {what})\n{audit.report()}"
    assert not judgement.ok, f"the token judge missed a wrong mapping ({mutation}, {what})\n{judgement.report()}"


@pytest.mark.parametrize("kind", ["gemma2", "gpt_oss"])
def test_generate_with_attention_variants_matches_the_reference(kind, monkeypatch):
    """Random bf16 Gemma 2 (a window of 8 on half its layers, soft-cap 20 on all) and gpt-oss (sinks
    on every layer, a window of 8 on half) through generate with "cupy_fa": every attention call
    against the float64 reference of its variant over the keys transformers passed (prompts of 40
    tokens, so the windows cut; transformers' sliding layers then keep the last 7 keys of each
    row). The mapping of each keyword onto the variants is checked against transformers' eager
    tokens on the CPU (tests/test_hf_integration_cpu.py)."""
    torch, transformers, hf = _imports()
    model = C.tiny_variant_model(kind, seed=21, device="cuda", dtype=torch.bfloat16)
    prompts = C.random_prompts(22, (40,) * 6, 256)[:6]  # no padding: each row's keys are all valid
    audit = C.AttentionAudit(f"{kind} variants")
    monkeypatch.setitem(transformers.AttentionInterface._global_mapping, hf.ATTENTION,
                        C.audited_dense(audit, hf.attention_forward, [0] * len(prompts)))
    model.set_attn_implementation(hf.ATTENTION)
    gen = transformers.GenerationConfig(max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = model.generate(torch.tensor(prompts, device="cuda"), generation_config=gen)
    print(audit.report())
    layers = model.config.num_hidden_layers
    assert out.shape == (6, 56) and audit.calls == 16 * layers, (out.shape, audit.calls)
    assert audit.kinds["window"] == 16 * layers // 2  # the sliding layers (every other one)
    if kind == "gemma2":
        assert audit.kinds["soft_cap"] == 16 * layers and audit.kinds["sinks"] == 0
    else:
        assert audit.kinds["sinks"] == 16 * layers and audit.kinds["soft_cap"] == 0
    assert audit.ok, audit.report()
