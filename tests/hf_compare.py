"""Shared by the transformers integration tests (tests/test_hf_integration_gpu.py and _cpu.py):
tiny random models built in code (no hub access), and the two instruments that judge a run of
cupy_fa inside transformers (written against transformers 5.17, 2026-12-01).

Why two. A tiny random bf16 model has near-flat logits: two correct bf16 runs (ours and
transformers' own ``paged|sdpa``) part at a near tie within 10-40 tokens, whichever attention
runs, because bf16 rounding anywhere in the model (batch composition, chunking, the attention's
own rounding) moves a logit by a few percent of the largest. Tokens alone cannot tell a correct
integration from a slightly wrong one, so:

1. :class:`AttentionAudit`, the hard evidence: every attention call of a run is checked where
   it happens. What transformers passes (query / key / value after RoPE, the paged cache
   tensors, ``cu_seq_lens_q`` / ``cu_seq_lens_k``, ``read_index`` / ``write_index``) is read
   back after our call, and our output is compared with :func:`cupy_fa.reference.paged_attention`
   (float64) over the keys transformers names, through :func:`cupy_fa.reference.check_attention`
   (per request and per query row, the project's bf16 bars). The reference's K/V are gathered
   with transformers' own ``read_index`` (one token per page, in its order; a batch of fresh
   prefills reads the step's own K/V, as ``paged|sdpa`` does), never with our page table, so a
   wrong mapping cannot hide in the reference; and the step's K/V rows must sit, bit for bit, at
   transformers' ``write_index`` slots. For ``generate`` the keys of a batch row are those past
   its left padding, which the test knows from its own prompts. Under CUDA graphs the tensors a
   capture saw are kept and read after every replay (a replay runs no Python).

2. The token judge, at the first token where ours and theirs part: the next-token logits of
   both runs at that step (captured from the runs themselves) are compared with the float32
   truth, a float32 copy of the same weights run on the shared context. Ours must be within
   :data:`LOGITS_TOL` of it (max |ours - fp32| / max |fp32|), and the two chosen tokens a near
   tie of the truth (|fp32[ours] - fp32[theirs]| / max |fp32| within :data:`TIE_TOL`). Over
   every token the two runs share, ours' median distance from the truth is at most
   :data:`MEDIAN_RATIO` times theirs. Every figure is reported, theirs too (transformers' own
   distance from the truth, for scale).

A :class:`BatchProbe` hooks transformers' continuous batching (``ModelRunner.compute_batch`` and
``_sample``, and the attention function) to feed both.
"""

import collections
import contextlib
import copy
import dataclasses

import numpy as np
from cupy_fa import families

# Max |logits - fp32 logits| / max |fp32 logits| of a correct bf16 run of these tiny 2-layer
# models, measured with CPU torch 2.13 (2026-12-01) over every token two runs share (11
# requests x 64 tokens; transformers' own bf16 paged|sdpa, sdpa and eager, and a float64
# stand-in of our kernels rounded to bf16): median 1.9e-2 .. 2.0e-2, largest 3.8e-2 (4.2e-2 for
# transformers' own); at a parting 1.5e-2 .. 3.4e-2. A wrong mapping (a kv_len one short, a
# dropped page) gave 7e-2 .. 1.4 at the first difference.
LOGITS_TOL = 5e-2
# |fp32[a] - fp32[b]| / max |fp32| of the two tokens at a parting of correct runs: measured up to
# 2.7e-2 (same runs); a flip needs a gap that bf16 noise of LOGITS_TOL's size can close.
TIE_TOL = 5e-2


def tiny_config(kind, head_dim, num_heads, num_kv_heads, layers=2, vocab=512):
    import transformers

    common = dict(vocab_size=vocab, hidden_size=head_dim * num_heads, intermediate_size=2 * head_dim * num_heads,
                  num_hidden_layers=layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  max_position_embeddings=4096, initializer_range=0.05,
                  bos_token_id=None, eos_token_id=None)  # no EOS: nothing masks a token or stops a run early
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


def tiny_variant_model(kind, seed, device="cpu", dtype=None, window=8, sliding=True):
    """A random Gemma 2 (sliding-window layers beside full ones, logit soft-capping) or gpt-oss
    (sinks on every layer, sliding-window layers) of 8 / 2 heads of 64 (a head dim cupy_fa takes),
    vocabulary 256; ``sliding=False``: every layer full attention (the soft-cap or the sinks alone)."""
    import torch
    import transformers


    head_dim = 64
    assert head_dim in families.common.HEAD_DIMS  # the kernels' head dims: BatchAttention refuses others
    common = dict(vocab_size=256, hidden_size=128, num_attention_heads=8, num_key_value_heads=2, head_dim=head_dim,
                  max_position_embeddings=512, sliding_window=window)
    if kind == "gemma2":
        layers = 4
        config = transformers.Gemma2Config(intermediate_size=256, num_hidden_layers=layers, attn_logit_softcapping=2.0,
                                           final_logit_softcapping=None, query_pre_attn_scalar=head_dim, **common)
    else:
        layers = 2
        config = transformers.GptOssConfig(intermediate_size=128, num_hidden_layers=layers, num_local_experts=4,
                                           num_experts_per_tok=2, **common)
    if not sliding:  # no window anywhere: a short sliding_window left in the config would still shape
        # generate's cache (and Gemma 2 builds its sliding mask whatever the layer types say)
        config.layer_types = ["full_attention"] * layers
        config.sliding_window = 4096
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, **({"dtype": dtype} if dtype else {})).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            if kind == "gpt_oss":  # sinks of a size that matters beside the scores
                attn.sinks.normal_(0.0, 2.0)
            else:  # scores of a few units, where a soft-cap of 2 bends them (random weights give ~0.1)
                attn.q_proj.weight.mul_(6.0)
                attn.k_proj.weight.mul_(6.0)
    return model


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


# ---- 1. the attention audit ----------------------------------------------------------------


def _bars(dtype):
    """check_attention's bars for a model dtype: the project's for bf16 / fp16; for a float32
    model (the CPU tests' stand-in, float64 rounded to float32) rounding only."""
    import torch

    if dtype == torch.bfloat16:
        return {"dtype": "bfloat16"}
    if dtype == torch.float16:
        return {"dtype": "float16"}
    return {"dtype": "bfloat16", "tol": 1e-5, "max_abs": 1e-5}


def _host(x):
    return x.detach().float().cpu().numpy()


def _one_token_pages(k, v, kv_lens):
    """[N, H, D] K and V of requests laid end to end -> one-token pages and the page table
    that names them in order (request b: tokens ``sum(kv_lens[:b]) ..``)."""
    starts = np.concatenate([[0], np.cumsum(kv_lens)[:-1]]).astype(np.int64)
    width = max(1, int(np.max(kv_lens, initial=0)))
    table = np.minimum(starts[:, None] + np.arange(width)[None, :], max(k.shape[0] - 1, 0))
    return _host(k)[:, None], _host(v)[:, None], table


class AttentionAudit:
    """Collects the verdicts on attention calls (see the module docstring). Never raises on a
    finding: ``failures`` lists each with its numbers, ``summary()`` gives the counts and the
    worst figures (so a passing log shows its margin)."""

    def __init__(self, label=""):
        self.label = label
        self.failures = []
        self.calls = 0
        self.requests = 0
        self.kinds = collections.Counter()
        self.worst = {"request_rel": (0.0, ""), "max_abs": (0.0, "")}
        self.bars = (0.0, 0.0)

    @property
    def ok(self):
        return not self.failures

    def _fail(self, text):
        self.failures.append(text)

    def _compare(self, where, ours, q, k_pages, v_pages, q_lens, kv_lens, table, scale, dtype, variant=None):
        from cupy_fa import reference

        ref = reference.paged_attention(_host(q), k_pages, v_pages, q_lens, kv_lens, table, causal=True,
                                        sm_scale=scale, **(variant or {}))
        bars = _bars(dtype)
        result = reference.check_attention(_host(ours), ref, q_lens=q_lens, label=where, **bars)
        self.bars = (bars.get("tol", reference.TOL[bars["dtype"]]), bars.get("max_abs", reference.MAX_ABS[bars["dtype"]]))
        self.calls += 1
        self.requests += result.counts.get("requests", 0)
        for key in self.worst:
            if key in result.worst and result.worst[key][0] > self.worst[key][0]:
                self.worst[key] = (result.worst[key][0], f"{where}, {result.worst[key][1]}")
        for line in result.failures[:4]:
            self._fail(f"{where}: {line}")
        if len(result.failures) > 4:
            self._fail(f"{where}: ... and {len(result.failures) - 4} more")

    def check_paged(self, where, module, query, key, value, out, kwargs):
        """One call of the paged attention (continuous batching), after it ran: ``query`` /
        ``key`` / ``value`` ``[1, H, T, D]`` as transformers passed them, ``out`` ``[1, T, H_q, D]``
        as it came back, ``kwargs`` the call's keyword arguments (``cache``, ``cu_seq_lens_*``,
        ``read_index``, ``write_index``, ``scaling``)."""
        import torch

        cache = kwargs["cache"]
        group, index = cache.layer_index_to_group_indices[module.layer_idx]
        k_cache, v_cache = cache.key_cache[index], cache.value_cache[index]  # [slots, H_kv, D]
        cu_k = kwargs["cu_seq_lens_k"]
        if isinstance(cu_k, dict):
            cu_k = cu_k["full_attention"]
        cu_q = kwargs["cu_seq_lens_q"].long().cpu()
        cu_k = cu_k.long().cpu()
        read, write = kwargs["read_index"][group], kwargs["write_index"][group]
        q_lens, kv_lens = (cu_q[1:] - cu_q[:-1]).numpy(), (cu_k[1:] - cu_k[:-1]).numpy()
        live = int(cu_q[-1])
        q = query[0].transpose(0, 1)[:live]
        k_new, v_new = key[0].transpose(0, 1)[:live], value[0].transpose(0, 1)[:live]
        ours = out[0][:live]  # transformers reads the output as [1, T, H_q, D]
        kinds = {"padded"} if (q_lens == 0).any() or query.shape[2] > live else set()
        if ((q_lens > 1) & (kv_lens > q_lens)).any():
            kinds.add("chunked prefill")
        if ((q_lens > 1) & (kv_lens == q_lens)).any():
            kinds.add("prefill")
        if (q_lens == 1).any():
            kinds.add("decode")
        if {"decode"} < kinds - {"padded"}:
            kinds.add("mixed")
        self.kinds.update(kinds)
        # the step's K/V rows, bit for bit, at transformers' write slots
        if write.numel() < live:
            self._fail(f"{where}: write_index has {write.numel()} slots for {live} live tokens")
            return
        slots = write[:live]
        wrong = ((k_cache[slots] != k_new).flatten(1).any(1) | (v_cache[slots] != v_new).flatten(1).any(1)).cpu()
        if bool(wrong.any()):
            t = int(torch.nonzero(wrong)[0])
            self._fail(f"{where}: {int(wrong.sum())} of {live} new K/V rows are not at transformers' write_index "
                       f"(first: token {t}, slot {int(slots[t])})")
        # the keys of each request as transformers names them: its read slots in order (a batch of
        # fresh prefills reads nothing from the cache, and paged|sdpa takes the step's own K/V)
        if read.numel():
            total = int(cu_k[-1])
            if read.numel() < total:
                self._fail(f"{where}: read_index has {read.numel()} slots for {total} keys")
                return
            k_ctx, v_ctx = k_cache[read[:total]], v_cache[read[:total]]
        else:
            if not torch.equal(cu_k, cu_q):
                self._fail(f"{where}: no read_index but cu_seq_lens_k {cu_k.tolist()} != cu_seq_lens_q")
                return
            k_ctx, v_ctx = k_new, v_new
        k_pages, v_pages, table = _one_token_pages(k_ctx, v_ctx, kv_lens)
        self._compare(where, ours, q, k_pages, v_pages, q_lens, kv_lens, table, _scale(module, kwargs, q), q.dtype)

    def check_dense(self, where, module, query, key, value, out, kwargs, left_pad):
        """One call of the dense attention (``generate``), after it ran: ``query`` ``[B, H_q, T, D]``,
        ``key`` / ``value`` ``[B, H_kv, L, D]`` (the layer's whole K/V), ``out`` ``[B, T, H_q, D]``;
        ``left_pad[b]`` the padding tokens the test put before row b's prompt. Row b's valid keys
        are positions ``left_pad[b] ..``, query t sits at position ``L - T + t``; a query on a
        padding position is not compared."""
        b, _, t, _ = query.shape
        length = key.shape[2]
        qs, ours, ks, vs, q_lens, kv_lens = [], [], [], [], [], []
        for r in range(b):
            pad = int(left_pad[r])
            first = max(0, pad - (length - t))
            qs.append(query[r, :, first:].transpose(0, 1))
            ours.append(out[r, first:])
            ks.append(key[r, :, pad:].transpose(0, 1))
            vs.append(value[r, :, pad:].transpose(0, 1))
            q_lens.append(t - first)
            kv_lens.append(length - pad)
        import torch

        q_lens, kv_lens = np.array(q_lens), np.array(kv_lens)
        self.kinds.update({"decode"} if t == 1 else {"prefill"})
        if (np.array(left_pad) > 0).any():
            self.kinds["padded"] += 1
        k_pages, v_pages, table = _one_token_pages(torch.cat(ks), torch.cat(vs), kv_lens)
        q = torch.cat(qs)
        variant = call_variant(module, kwargs)
        for name in ("window", "soft_cap", "sinks"):
            if variant[name] is not None:
                self.kinds[name] += 1
        self._compare(where, torch.cat(ours), q, k_pages, v_pages, q_lens, kv_lens, table,
                      _scale(module, kwargs, q), q.dtype, variant)

    def summary(self):
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(self.kinds.items()))
        tol, max_abs = self.bars
        return (f"attention: {self.calls} calls, {self.requests} request checks ({kinds}), worst request rel "
                f"{self.worst['request_rel'][0]:.1e} (bar {tol:.0e}), worst max-abs/max|ref| "
                f"{self.worst['max_abs'][0]:.1e} (bar {max_abs:.0e}): "
                f"{'ok' if self.ok else f'{len(self.failures)} FAILING'}")

    def report(self, limit=12):
        where = f"  (worst request rel at {self.worst['request_rel'][1] or '-'}; max-abs at {self.worst['max_abs'][1] or '-'})"
        return "\n".join([self.summary(), where] + self.failures[:limit] +
                         ([f"... and {len(self.failures) - limit} more"] if len(self.failures) > limit else []))


def call_variant(module, kwargs):
    """The attention variant transformers asked this call for, as cupy_fa.reference takes it
    (``window`` / ``soft_cap`` / ``sinks``, None where off): its ``sliding_window``, ``softcap``
    and ``s_aux`` keywords, or the module's ``sliding_window`` / ``sinks``. Counted in ``kinds``."""
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None)) or None
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = getattr(module, "sinks", None)
    return dict(window=window, soft_cap=kwargs.get("softcap") or None,
                sinks=None if sinks is None else _host(sinks.float()).astype(np.float64))


def _scale(module, kwargs, q):
    scale = kwargs.get("scaling")
    if scale is None:
        scale = getattr(module, "scaling", None)
    return float(scale) if scale is not None else q.shape[-1] ** -0.5


def audited_dense(audit, attention, left_pad):
    """``attention`` (an AttentionInterface function of ``generate``) with every call checked
    by ``audit`` right after it ran (generate runs no graphs: each call is eager)."""
    state = {"call": 0}

    def wrapper(module, query, key, value, attention_mask=None, **kwargs):
        out, weights = attention(module, query, key, value, attention_mask, **kwargs)
        where = f"{audit.label} forward {state['call'] // module.config.num_hidden_layers} layer {module.layer_idx}"
        state["call"] += 1
        try:
            audit.check_dense(where, module, query, key, value, out, kwargs, left_pad)
        except Exception as exc:  # the audit itself broke: a finding, not a pass
            audit._fail(f"{where}: audit error {type(exc).__name__}: {exc}")
        return out, weights

    return wrapper


# ---- the probe on continuous batching -------------------------------------------------------


def _requests_in_batch(io):
    pairs = getattr(io, "io_pairs", None)  # async batching: two IO pairs, the current one computes
    return pairs[io.current_pair].host_io.requests_in_batch if pairs is not None else io.requests_in_batch


class BatchProbe:
    """Hooks one ``generate_batch`` run: each step's attention calls (when ``audit`` is given)
    are checked by it after the step, and the step's next-token logits are kept per (request
    id, position of the token they follow). Eager steps are read as they run; a step captured
    into a CUDA graph keeps the tensors the capture saw, and every replay of that graph is read
    through them (the graph writes the same addresses).

    ``steps`` counts the steps seen by how they ran (eager / captured / replayed / warmup: the
    engine's own dummy steps, not checked); ``failures`` lists what went wrong in the probe."""

    def __init__(self, layers, audit=None):
        self.layers = layers
        self.audit = audit
        self.logits = {}
        self.steps = collections.Counter()
        self.failures = []
        self._eager, self._capturing, self._graphs = [], [], {}

    def install(self, monkeypatch, name, attention=None):
        """Hooks transformers (restored by ``monkeypatch``); ``attention``: the function behind
        the implementation ``name``, wrapped so its calls are recorded (None: not audited)."""
        import transformers
        from transformers.generation.continuous_batching import model_runner

        runner = model_runner.ModelRunner
        real_compute, real_sample = runner.compute_batch, runner._sample
        probe = self

        def compute_batch(runner_self, model, batch_data):
            return probe._step(real_compute, runner_self, model, batch_data)

        def sample(runner_self, scores, output_ids):
            probe._record(("scores", scores))
            return real_sample(runner_self, scores, output_ids)

        monkeypatch.setattr(runner, "compute_batch", compute_batch)
        monkeypatch.setattr(runner, "_sample", sample)
        if attention is not None:
            def audited(module, query, key, value, attention_mask=None, **kwargs):
                out, weights = attention(module, query, key, value, attention_mask, **kwargs)
                probe._record(("attention", module, query, key, value, out, dict(kwargs)))
                return out, weights

            monkeypatch.setitem(transformers.AttentionInterface._global_mapping, name, audited)
        return self

    def _record(self, item):
        import torch

        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        (self._capturing if capturing else self._eager).append(item)

    def _step(self, real, runner_self, model, batch_data):
        import torch

        io = runner_self.inputs_and_outputs
        use_graph = runner_self._get_forward_fn(use_block_table=io.use_block_table)[1]
        graph = io.get_graph() if use_graph else None  # not None: this call replays it
        requests = [(fs.state.request_id, fs.has_new_token) for fs in _requests_in_batch(io)]
        self._eager, self._capturing = [], []
        result = real(runner_self, model, batch_data)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        number = sum(self.steps.values())
        try:
            if graph is not None:
                entry = self._graphs.get(id(graph))
                if entry is None:
                    self.failures.append(f"step {number}: replayed a CUDA graph whose capture the probe did not see")
                    return result
                records, how = entry[1], "replayed"
            else:
                records, how = self._eager, "eager"
                if self._capturing:  # this step ran once eagerly, then was captured
                    new = io.get_graph()
                    self._graphs[id(new)] = (new, self._capturing)
                    how = "captured"
            if all(rid.startswith("__warmup_") for rid, _ in requests):
                self.steps["warmup"] += 1
                return result
            self.steps[how] += 1
            self._check_step(number, how, records, batch_data, requests)
        except Exception as exc:  # a broken probe is a finding, never a pass
            self.failures.append(f"step {number}: probe error {type(exc).__name__}: {exc}")
        return result

    def _check_step(self, number, how, records, batch_data, requests):
        attention = [r for r in records if r[0] == "attention"]
        scores = [r[1] for r in records if r[0] == "scores"]
        if self.audit is not None:
            if len(attention) != self.layers:
                self.failures.append(f"step {number} ({how}): {len(attention)} attention calls, expected {self.layers}")
            for _, module, query, key, value, out, kwargs in attention:
                where = f"{self.audit.label} step {number} layer {module.layer_idx} ({how})"
                try:
                    self.audit.check_paged(where, module, query, key, value, out, kwargs)
                except Exception as exc:
                    self.audit._fail(f"{where}: audit error {type(exc).__name__}: {exc}")
        if len(scores) != 1:
            self.failures.append(f"step {number} ({how}): {len(scores)} sampling calls, expected 1")
            return
        cu_q = batch_data["cu_seq_lens_q"].long().cpu()
        rows = batch_data["logits_indices"].long().cpu()
        positions = batch_data["position_ids"][0].long().cpu()
        real = sum(new for _, new in requests)
        values = scores[0][0, :real].float().cpu()
        for j in range(real):
            p = int(rows[j])
            b = int(np.searchsorted(cu_q.numpy(), p, side="right")) - 1
            rid, new = requests[b]
            if not new or p != int(cu_q[b + 1]) - 1:
                self.failures.append(f"step {number}: logits row {j} (token {p}) is not the last token of a request "
                                     f"that samples")
                continue
            self.logits[(rid, int(positions[p]))] = values[j]

    def lookup(self, request_ids, prompts):
        """(r, i) -> the logits this run sampled its token i of request r from (None if not seen)."""
        return lambda r, i: self.logits.get((request_ids[r], len(prompts[r]) - 1 + i))


def logits_match_tokens(tokens, lookup, what):
    """Every token of every request has its captured logits, whose argmax is that token (the
    probe's bookkeeping checked against the run's own output). Returns failure lines."""
    failures = []
    for r, row in enumerate(tokens):
        missing = [i for i in range(len(row)) if lookup(r, i) is None]
        if missing:
            failures.append(f"{what}: request {r}: no logits captured for tokens {missing[:8]}")
            continue
        wrong = [i for i in range(len(row)) if int(lookup(r, i).argmax()) != row[i]]
        if wrong:
            failures.append(f"{what}: request {r}: the captured logits of tokens {wrong[:8]} do not give its tokens")
    return failures


# ---- 2. the token judge -----------------------------------------------------------------------


class Float32Twin:
    """A float32 copy of the model's weights (bf16 weights widen exactly), eager attention and
    full-precision matmuls: the truth the runs' logits are held to."""

    def __init__(self, model):
        self.model = copy.deepcopy(model).float()
        self.model.set_attn_implementation("eager")

    def logits(self, context, first):
        """float64 host logits ``[len(context) - first, V]`` that follow positions ``first ..``
        of ``context`` (a token list), from one forward."""
        import torch

        with torch.no_grad(), _highest_precision():
            ids = torch.tensor([list(context)], device=self.model.device)
            return self.model(input_ids=ids).logits[0, first:].double().cpu()


@contextlib.contextmanager
def _highest_precision():
    import torch

    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def _rel(x, ref):
    return float((x.double().cpu() - ref).abs().max()) / float(ref.abs().max())


@dataclasses.dataclass
class Verdict:
    request: int
    tokens: int
    first_difference: object = None  # None: all tokens equal
    ours: int = -1
    theirs: int = -1
    ours_rel: float = 0.0    # max |ours' logits - fp32| / max |fp32| at the first difference
    theirs_rel: float = 0.0  # the same for theirs
    runs_rel: float = 0.0    # max |ours' - theirs' logits| / max |fp32|
    tie: float = 0.0         # |fp32[ours] - fp32[theirs]| / max |fp32|
    prefix_max: float = 0.0  # the largest ours-vs-fp32 over the tokens both runs share
    ok: bool = True
    note: str = ""

    def line(self):
        head = f"request {self.request:2d}: "
        if self.note:
            return head + f"{self.note} -> FAIL"
        along = f"ours-vs-fp32 logits at most {self.prefix_max:.2e} along the shared tokens"
        if self.first_difference is None:
            return head + f"{self.tokens} tokens equal; {along}"
        return head + (f"first difference at token {self.first_difference} ({self.ours} vs {self.theirs}): "
                       f"ours-vs-fp32 logits {self.ours_rel:.2e} (tol {LOGITS_TOL:.0e}; theirs {self.theirs_rel:.2e}, "
                       f"ours-vs-theirs {self.runs_rel:.2e}), fp32 tie {self.tie:.2e} (tol {TIE_TOL:.0e}); {along} "
                       f"-> {'ok' if self.ok else 'FAIL'}")


# Over every token both runs share, the median ours-vs-fp32 may be at most this times theirs: a
# correct run is as close to the truth as transformers' own (measured 0.98-1.0x on CPU; a
# kv_len off by one, 3x).
MEDIAN_RATIO = 1.5


@dataclasses.dataclass
class Judgement:
    verdicts: list
    ours_steps: object    # ours-vs-fp32 at every shared token of every request
    theirs_steps: object  # the same for theirs

    @property
    def medians(self):
        return float(np.median(self.ours_steps)), float(np.median(self.theirs_steps))

    @property
    def ok(self):
        ours, theirs = self.medians
        return all(v.ok for v in self.verdicts) and ours <= MEDIAN_RATIO * theirs

    def line(self):
        parted = [v for v in self.verdicts if v.first_difference is not None]
        ours, theirs = self.medians
        return (f"tokens: {len(self.verdicts)} requests, {len(self.verdicts) - len(parted)} equal over "
                f"{max(v.tokens for v in self.verdicts)}, {len(parted)} part; at the first difference ours-vs-fp32 "
                f"logits <= {max((v.ours_rel for v in parted), default=0.0):.1e} (tol {LOGITS_TOL:.0e}), fp32 tie <= "
                f"{max((v.tie for v in parted), default=0.0):.1e} (tol {TIE_TOL:.0e}); over {len(self.ours_steps)} "
                f"shared tokens median ours-vs-fp32 {ours:.1e}, theirs {theirs:.1e} (bar {MEDIAN_RATIO:g}x): "
                f"{'ok' if self.ok else 'FAIL'}")

    def report(self, equal_lines=False):
        return "\n".join([v.line() for v in self.verdicts if equal_lines or v.first_difference is not None or not v.ok]
                         + [self.line()])


def judge(prompts, ours, theirs, ours_logits, theirs_logits, truth):
    """Judges token lists ``ours`` vs ``theirs`` (one per request). ``ours_logits(r, i)`` /
    ``theirs_logits(r, i)``: the logits each run sampled token i of request r from (None when
    not captured); ``truth``: a :class:`Float32Twin`. Per request: the float32 logits of every
    token both runs share (one forward of the prompt and those tokens); at the first
    difference, ours within :data:`LOGITS_TOL` of them and the two tokens a tie within
    :data:`TIE_TOL`. Over all shared tokens, ours' median distance within :data:`MEDIAN_RATIO`
    of theirs. Returns a :class:`Judgement`."""
    verdicts, ours_steps, theirs_steps = [], [], []
    for r, (prompt, a, b) in enumerate(zip(prompts, ours, theirs)):
        v = Verdict(r, len(a))
        verdicts.append(v)
        i = first_difference(a, b)
        if i is not None and i >= min(len(a), len(b)):
            v.first_difference, v.ok, v.note = i, False, f"one run stopped early ({len(a)} vs {len(b)} tokens)"
            continue
        last = len(a) - 1 if i is None else i  # tokens 0 .. last follow a context both runs share
        mine = [ours_logits(r, s) for s in range(last + 1)]
        their = [theirs_logits(r, s) for s in range(last + 1)]
        if any(x is None for x in mine + their):
            v.ok, v.note = False, "the runs' logits were not all captured"
            continue
        ref = truth.logits(list(prompt) + list(b[:last]), len(prompt) - 1)
        mine_rel = [_rel(x, ref[s]) for s, x in enumerate(mine)]
        ours_steps += mine_rel
        theirs_steps += [_rel(x, ref[s]) for s, x in enumerate(their)]
        v.prefix_max = max(mine_rel)
        if i is None:
            continue
        scale = float(ref[i].abs().max())
        v.first_difference, v.ours, v.theirs = i, a[i], b[i]
        v.ours_rel, v.theirs_rel = mine_rel[i], theirs_steps[-1]
        v.runs_rel = float((mine[i].double().cpu() - their[i].double().cpu()).abs().max()) / scale
        v.tie = abs(float(ref[i][a[i]] - ref[i][b[i]])) / scale
        v.ok = v.ours_rel <= LOGITS_TOL and v.tie <= TIE_TOL
    return Judgement(verdicts, np.array(ours_steps or [0.0]), np.array(theirs_steps or [0.0]))


# ---- mutations: wrong mappings the instruments must catch ---------------------------------------


def _kv_len_minus_one(step):
    import torch

    step.kv_lens = torch.where(step.kv_lens > step.q_lens, step.kv_lens - 1, step.kv_lens)
    return step


def _dropped_page(step):
    if step.page_table.shape[1] > 1:  # a request's second page reads its first one's block
        step.page_table = step.page_table.clone()
        step.page_table[:, 1] = step.page_table[:, 0]
    return step


MUTATIONS = {"kv_len - 1": _kv_len_minus_one, "a dropped page": _dropped_page}


def mutate(monkeypatch, hf, name):
    """Makes the integration's mapping (``paged_step`` and ``dense_step`` of
    ``cupy_fa.integrations.transformers``) wrong in the way ``name`` says."""
    change = MUTATIONS[name]
    for builder in ("paged_step", "dense_step"):
        real = getattr(hf, builder)
        monkeypatch.setattr(hf, builder, lambda *args, _real=real, **kwargs: change(_real(*args, **kwargs)))
