"""Shared by the transformers integration tests: tiny random models built in code (no hub
access), and the token comparison of two attention implementations with its judgement at
the first differing token.

Two greedy runs of the same bf16 model may part where two tokens are a near tie. Where a
request's tokens differ, the logits at the first difference are recomputed by plain forwards
of the shared context (prompt + the tokens both runs agree on) with the two implementations:
they must agree within ``LOGITS_TOL`` (max |ours - ref| over max |ref|), and the two chosen
tokens must be a tie that this disagreement explains: their reference logits at most twice
the largest logit difference apart (each may move by it, in opposite directions). Every
figure is reported.
"""

import dataclasses

LOGITS_TOL = 2e-2  # |ours - ref|_inf / |ref|_inf of the next-token logits after every bf16 layer


def tiny_config(kind, head_dim, num_heads, num_kv_heads, layers=2, vocab=512):
    import transformers

    common = dict(vocab_size=vocab, hidden_size=head_dim * num_heads, intermediate_size=2 * head_dim * num_heads,
                  num_hidden_layers=layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  max_position_embeddings=4096, initializer_range=0.05)
    if kind == "llama":
        return transformers.LlamaConfig(head_dim=head_dim, **common)
    if kind == "qwen2":  # Qwen2: q/k/v biases, head dim = hidden / heads
        return transformers.Qwen2Config(**common)
    raise ValueError(kind)


def build_model(config, device, dtype, seed, attn_implementation="sdpa"):
    import torch
    import transformers

    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                              attn_implementation=attn_implementation)
    return model.eval()


def random_prompts(seed, lengths, vocab):
    import torch

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    # one request shares most of the longest prompt (whole blocks of it, where prefix sharing is on)
    prompts.append(prompts[longest][: max(1, len(prompts[longest]) * 3 // 4)] + [3, 5, 7])
    return prompts


def first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def next_token_logits(model, implementation, context):
    """float32 next-token logits of a plain forward over ``context`` (a token list)."""
    import torch

    model.set_attn_implementation(implementation)
    ids = torch.tensor([context], device=model.device)
    with torch.no_grad():
        return model(input_ids=ids).logits[0, -1].float()


@dataclasses.dataclass
class Verdict:
    request: int
    tokens: int
    first_difference: object = None  # None: all tokens equal
    ours: int = -1
    theirs: int = -1
    logits_rel: float = 0.0   # max |ours - ref| / max |ref| of the logits at the first difference
    tie_margin: float = 0.0   # |ref[ours] - ref[theirs]| / max |ref|
    ok: bool = True

    def line(self):
        if self.first_difference is None:
            return f"request {self.request:2d}: {self.tokens} tokens equal"
        return (f"request {self.request:2d}: first difference at token {self.first_difference} ({self.ours} vs "
                f"{self.theirs}); logits rel diff {self.logits_rel:.2e} (tol {LOGITS_TOL:.0e}), tie margin "
                f"{self.tie_margin:.2e} of max |logit| (tol 2 x the diff) -> {'ok' if self.ok else 'FAIL'}")


def judge(model, prompts, ours, theirs, plain_ours, plain_theirs):
    """Verdicts per request of token lists ``ours`` vs ``theirs``; where they part, the plain
    forwards ``plain_ours`` / ``plain_theirs`` (implementation names) give the logits."""
    verdicts = []
    for r, (prompt, a, b) in enumerate(zip(prompts, ours, theirs)):
        i = first_difference(a, b)
        v = Verdict(r, len(a))
        if i is not None:
            if i >= min(len(a), len(b)):  # one run stopped early: no token to compare
                v.first_difference, v.ok = i, False
                verdicts.append(v)
                continue
            context = list(prompt) + list(b[:i])
            ref = next_token_logits(model, plain_theirs, context)
            mine = next_token_logits(model, plain_ours, context)
            scale = float(ref.abs().max())
            v.first_difference, v.ours, v.theirs = i, a[i], b[i]
            v.logits_rel = float((mine - ref).abs().max()) / scale
            v.tie_margin = abs(float(ref[a[i]] - ref[b[i]])) / scale
            v.ok = v.logits_rel < LOGITS_TOL and v.tie_margin <= 2 * v.logits_rel
        verdicts.append(v)
    return verdicts


def summary(verdicts):
    equal = sum(v.first_difference is None for v in verdicts)
    worst_tie = max((v.tie_margin for v in verdicts if v.first_difference is not None), default=0.0)
    worst_logits = max((v.logits_rel for v in verdicts if v.first_difference is not None), default=0.0)
    return equal, worst_tie, worst_logits
