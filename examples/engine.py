"""A small serving loop that runs a Hugging Face Llama model with cupy_fa attention.

What it shows: cupy_fa works inside an ordinary torch engine. The engine owns a paged KV cache,
runs the transformer layers itself with the weights of a ``transformers.LlamaForCausalLM``, and
hands only two things to an attention backend: writing the new K/V into the cache and attention
over the paged cache. It serves a batch of prompts in three forward modes (docs/design.md):

* EXTEND        -- prefill, including one prompt whose first pages are shared with another
                   prompt (an extend over a cached prefix: those pages are reused, not recomputed);
* DECODE        -- plain greedy decoding, one token per request per step;
* chain speculative decoding (EAGLE-style, with a draft model that is the target truncated to its
  first layers): draft DECODE steps, TARGET_VERIFY, DRAFT_EXTEND_V2,

optionally under CUDA graphs (one graph per (model, mode, padded batch size)), and checks the
results against transformers itself. ``Shard`` splits its attention heads over tensor-parallel
ranks; examples/tp_engine.py runs it that way, one process per GPU.

Run it from the repository root (see examples/README.md)::

    PYTHONPATH=. python examples/engine.py                       # cupy_fa on cuda
    PYTHONPATH=. python examples/engine.py --device cpu --backend torch_ref

The speculative scheme (S = --num-draft, W = S + 1 = sglang's ``draft_token_num``)
-------------------------------------------------------------------------------------
Let ``tokens`` be a request's prompt plus everything emitted so far and n = len(tokens); the last
token x0 = tokens[n-1] is the *pending* token (emitted, not yet run through the target).

* target cache: holds K/V of tokens[0 : n-1] between steps (everything but the pending token);
* draft cache:  holds K/V of tokens[0 : n] between rounds (pending token included), and the draft
  already knows its first proposal d1 (the output of the step that wrote x0).

One round, for every running request at once (batched):

1. draft DECODE, S-1 steps: step j feeds d_j at position n-1+j (q_len 1, kv_len n+j) -> d_{j+1}.
2. TARGET_VERIFY: feeds the W tokens [x0, d1 .. dS] at positions n-1 .. n-1+S
   (q_len W, kv_len n-1+W; their K/V are written first, causal among them). Row i's argmax g_i is
   the target's greedy token after position n-1+i. Accept the longest prefix d1..dA with
   d_{i+1} == g_i, emit d1..dA and the bonus token g_A (A+1 tokens, all of them the target's own
   greedy choices, so the output equals plain greedy decoding). The rejected drafts' K/V are
   dropped by setting the target length to n' - 1, n' = n + A + 1; they are overwritten later.
3. DRAFT_EXTEND_V2: the draft recomputes a fixed window of the last W tokens,
   tokens[n'-W : n'] at positions n'-W .. n'-1 (q_len W fixed, kv_len n' = prefix + W). Its last
   row is the next round's d1. What is recomputed: of the W positions only the bonus token
   (position n'-1) is new, plus d_S (position n'-2) when all S drafts were accepted (its K/V was
   never written: d_S was never fed to the draft). The other W-1 (or W-2) positions hold accepted
   tokens whose draft K/V was already right; they are rewritten with the same values. Rewriting is
   the price of a fixed q_len, which makes the step one CUDA graph per batch size (sglang's
   "v2" draft extend). Those already-known rows must also predict what the draft predicted for
   them during drafting: the engine counts that agreement ("draft-extend consistency"); it is
   the check that catches the regression this project started from (a DRAFT_EXTEND_V2 kv_len that
   leaves the window's own K/V out of the attention).

Prefill: the target EXTENDs the prompt (q_len = prompt - cached prefix, kv_len = prompt); its
last row gives the first token. For speculative decoding the draft then EXTENDs prompt + that
token, and its last row gives d1.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time

import numpy as np

try:
    import torch
except ImportError:  # one line, not a traceback
    sys.exit("examples/engine.py needs torch (on a CPU build it runs with a torch reference in cupy_fa's place): "
             "pip install torch")

from cupy_fa.graph import default_buckets
from cupy_fa.modes import ForwardMode, contract_lengths

# --------------------------------------------------------------------------------------------
# Forward modes and the one place where a mode becomes (q_len, kv_len)
# --------------------------------------------------------------------------------------------


# The engine's modes are cupy_fa's: the contract lives in one documented place, cupy_fa/modes.py.
Mode = ForwardMode

# Modes with a fixed q_len per request (Mode.fixed_q_len) run as CUDA graphs, one per padded
# batch size.


def mode_lengths(mode: Mode, seq_len: int, cached: int, window: int) -> tuple[int, int]:
    """(q_len, kv_len) of one request for one forward step, through ``cupy_fa.contract_lengths``.

    ``seq_len`` is the length of the token sequence the model has seen once this step is done
    (its last token is the last query of the step), ``cached`` the number of leading tokens whose
    K/V that model's cache already holds (a shared prefix, or 0, for EXTEND), ``window`` is
    W = num_draft + 1. What this engine feeds per mode (P = tokens cached before the step):

    ==================  ============  ============  =============================
    mode                q_len         kv_len        tokens fed
    ==================  ============  ============  =============================
    EXTEND              seq - P       seq           prompt (+ first token, draft)
    DECODE              1             P + 1         pending token / last draft
    TARGET_VERIFY       W             P + W         [x0, d1 .. dS]
    DRAFT_EXTEND_V2     W (fixed)     P + W         last W accepted tokens
    ==================  ============  ============  =============================
    """
    if mode is Mode.EXTEND:
        q_len, kv_len = contract_lengths(mode, prefix_lens=cached, new_lens=seq_len - cached)
    elif mode is Mode.DECODE:
        q_len, kv_len = contract_lengths(mode, prefix_lens=seq_len - 1)
    elif mode in (Mode.TARGET_VERIFY, Mode.DRAFT_EXTEND_V2):
        q_len, kv_len = contract_lengths(mode, prefix_lens=seq_len - window, num_draft_tokens=window)
    else:
        raise ValueError(f"mode {mode} is not used by this engine")
    if not 1 <= q_len <= kv_len:
        raise ValueError(f"{mode.name}: q_len {q_len} kv_len {kv_len} breaks 1 <= q_len <= kv_len")
    return q_len, kv_len


def batch_bucket(batch_size: int, max_batch: int) -> int:
    """Padded batch size of a graph-mode step: cupy_fa's default bucket that holds it (the next
    power of two, at most the capacity)."""
    return next((b for b in default_buckets(max_batch) if b >= batch_size), max_batch)


# --------------------------------------------------------------------------------------------
# Models: a random Llama target and a draft that is its truncation
# --------------------------------------------------------------------------------------------


def build_models(args, device):
    """Target LlamaForCausalLM with seeded random weights, and the draft: the same model cut to
    its first ``--draft-layers`` layers (same embeddings, final norm and lm_head)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def config(num_layers):
        return LlamaConfig(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
            num_hidden_layers=num_layers, num_attention_heads=args.heads,
            num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
            max_position_embeddings=4096, initializer_range=args.init_std,
            bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
            attn_implementation="eager")

    torch.manual_seed(args.seed)
    target = LlamaForCausalLM(config(args.layers)).float().eval()
    # Layers past the draft's depth write less into the residual stream, so the truncated model
    # stays a useful draft (a trained draft is fitted to the target; random weights are not).
    with torch.no_grad():
        for layer in target.model.layers[args.draft_layers:]:
            layer.self_attn.o_proj.weight.mul_(args.late_layer_scale)
            layer.mlp.down_proj.weight.mul_(args.late_layer_scale)
    draft = LlamaForCausalLM(config(args.draft_layers)).float().eval()
    missing, _unexpected = draft.load_state_dict(target.state_dict(), strict=False)
    assert not missing, missing
    for m in (target, draft):
        m.generation_config.eos_token_id = None
        m.generation_config.pad_token_id = 0
    return target.to(device), draft.to(device)


def make_prompts(vocab: int, page_size: int, window: int, seed: int):
    """Four prompts of different lengths; prompt 3 shares whole pages of prompt 2's start.

    The shared part is a whole number of pages, and both owners keep at least W-2 tokens of their
    own after it, so no request ever writes into a shared page (the DRAFT_EXTEND_V2 window reaches
    back W-2 tokens before the first emitted token).
    Returns (prompts, shared) with shared = [(borrower, owner, n_tokens)].
    """
    g = np.random.default_rng(seed + 1)
    shared_len = page_size * max(1, 32 // page_size)
    own = max(8, window)
    lens = [max(5, window), 17, shared_len + own, shared_len + own - 2]
    prompts = [g.integers(0, vocab, n).tolist() for n in lens]
    prompts[3][:shared_len] = prompts[2][:shared_len]
    return prompts, [(3, 2, shared_len)]


# --------------------------------------------------------------------------------------------
# Paged KV bookkeeping (host side): pages, page lists, slots
# --------------------------------------------------------------------------------------------


class PagePool:
    """Physical pages of one model's cache. Page 0 is the scratch page that no request owns
    (padded rows write there); the others are handed out from a shuffled free list."""

    SCRATCH = 0

    def __init__(self, num_pages: int, page_size: int, seed: int):
        self.num_pages, self.page_size = num_pages, page_size
        self.reset(seed)

    def reset(self, seed: int):
        self.free = list(range(1, self.num_pages))
        np.random.default_rng(seed).shuffle(self.free)
        self.refs = [0] * self.num_pages

    def alloc(self) -> int:
        if not self.free:
            raise RuntimeError("KV cache out of pages")
        page = self.free.pop()
        self.refs[page] = 1
        return page


class SeqKV:
    """One request's view of one model's cache: its page list and its valid length."""

    def __init__(self, pool: PagePool):
        self.pool, self.pages, self.length = pool, [], 0

    def borrow_prefix(self, owner: "SeqKV", n_tokens: int):
        """Reuse the owner's first n_tokens (whole pages) as this request's cached prefix."""
        ps = self.pool.page_size
        assert not self.pages and n_tokens % ps == 0 and owner.length >= n_tokens
        self.pages = owner.pages[: n_tokens // ps]
        for p in self.pages:
            self.pool.refs[p] += 1
        self.length = n_tokens

    def reserve(self, n_tokens: int):
        while len(self.pages) * self.pool.page_size < n_tokens:
            self.pages.append(self.pool.alloc())

    def slots(self, start: int, stop: int) -> np.ndarray:
        """Cache slots (page * page_size + offset) of positions start..stop-1, which must be in
        pages this request owns alone (shared pages are read-only)."""
        ps = self.pool.page_size
        pos = np.arange(start, stop)
        pages = np.asarray(self.pages, dtype=np.int64)[pos // ps]
        shared = [int(p) for p in np.unique(pages) if self.pool.refs[p] != 1]
        assert not shared, f"write into shared pages {shared}"
        return pages * ps + pos % ps


# --------------------------------------------------------------------------------------------
# Attention backends: plan once per step, then per layer write_kv + attend
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class CacheSpec:
    num_layers: int
    num_pages: int
    page_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    max_batch: int                 # largest (padded) batch of one step
    max_pages_per_request: int
    max_tokens: dict               # Mode -> most query tokens of one step in that mode


class TorchRefBackend:
    """Pure torch reference: gathers each request's pages and runs masked softmax attention in
    fp32 over the bf16/fp16 cache. No host sync, static shapes: it can be captured in a CUDA graph
    too, so ``--backend torch_ref`` is a control for the cupy_fa runs."""

    name = "torch_ref"

    def __init__(self, spec: CacheSpec):
        self.spec = spec
        shape = (spec.num_pages, spec.page_size, spec.num_kv_heads, spec.head_dim)
        self.k = [torch.zeros(shape, dtype=spec.dtype, device=spec.device) for _ in range(spec.num_layers)]
        self.v = [torch.zeros(shape, dtype=spec.dtype, device=spec.device) for _ in range(spec.num_layers)]

    def plan(self, mode, q_lens, kv_lens, page_table, max_q_len):
        self.q_lens, self.kv_lens = q_lens.long(), kv_lens.long()
        self.page_table = page_table.long()
        self._tokens = None            # per-token metadata, derived on first attend

    def _token_meta(self, num_tokens):
        """request, absolute position and validity of each query row (rows past sum(q_lens) are
        padding), computed on the device."""
        cu = torch.cumsum(self.q_lens, 0)
        t = torch.arange(num_tokens, device=cu.device)
        req = torch.searchsorted(cu, t, right=True)
        valid = req < cu.numel()
        req = req.clamp(max=cu.numel() - 1)
        first = cu[req] - self.q_lens[req]
        qpos = self.kv_lens[req] - self.q_lens[req] + (t - first)
        return req, qpos, valid

    def write_kv(self, layer, k, v, slots):
        s = self.spec
        self.k[layer].view(-1, s.num_kv_heads, s.head_dim).index_copy_(0, slots, k)
        self.v[layer].view(-1, s.num_kv_heads, s.head_dim).index_copy_(0, slots, v)

    def attend(self, layer, q):
        s = self.spec
        T, B = q.shape[0], self.page_table.shape[0]
        if self._tokens is None:
            self._tokens = self._token_meta(T)
        req, qpos, valid = self._tokens
        L = self.page_table.shape[1] * s.page_size
        k = self.k[layer][self.page_table].reshape(B, L, s.num_kv_heads, s.head_dim)[req].float()
        v = self.v[layer][self.page_table].reshape(B, L, s.num_kv_heads, s.head_dim)[req].float()
        group = s.num_q_heads // s.num_kv_heads
        qf = q.float().view(T, s.num_kv_heads, group, s.head_dim)
        scores = torch.einsum("tkgd,tlkd->tkgl", qf, k) * (s.head_dim ** -0.5)
        keys = torch.arange(L, device=q.device)
        mask = keys[None, :] <= qpos[:, None]            # causal, bottom-right aligned
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
        out = torch.einsum("tkgl,tlkd->tkgd", torch.softmax(scores, dim=-1), v)
        out = torch.where(valid[:, None, None, None], out, torch.zeros((), device=q.device))
        return out.reshape(T, s.num_q_heads, s.head_dim).to(s.dtype)


class CupyFABackend:
    """cupy_fa: one PagedKVCache per layer (zero-copy over the torch tensors), one BatchAttention
    per forward mode (plan once per step, run per layer: all layers share the metadata), each
    bound to the engine's device (a tensor-parallel rank's own GPU, whatever CuPy's current
    device is)."""

    name = "cupy_fa"
    DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}

    def __init__(self, spec: CacheSpec):
        import cupy_fa

        self.spec = spec
        shape = (spec.num_pages, spec.page_size, spec.num_kv_heads, spec.head_dim)
        self.k = [torch.zeros(shape, dtype=spec.dtype, device=spec.device) for _ in range(spec.num_layers)]
        self.v = [torch.zeros(shape, dtype=spec.dtype, device=spec.device) for _ in range(spec.num_layers)]
        self.caches = [cupy_fa.PagedKVCache(k, v) for k, v in zip(self.k, self.v)]
        self.attn, self.out = {}, {}
        for mode, max_tokens in spec.max_tokens.items():
            self.attn[mode] = cupy_fa.BatchAttention(
                spec.num_q_heads, spec.num_kv_heads, spec.head_dim, dtype=self.DTYPE_NAMES[spec.dtype],
                max_batch_size=spec.max_batch, max_num_tokens=max_tokens,
                max_pages_per_request=spec.max_pages_per_request, device=spec.device)
            self.out[mode] = torch.zeros((max_tokens, spec.num_q_heads, spec.head_dim),
                                         dtype=spec.dtype, device=spec.device)
        self.mode = None

    def plan(self, mode, q_lens, kv_lens, page_table, max_q_len):
        self.mode = mode
        # the kv bound keeps a device-length plan's grid (and its merge launch) to what the page
        # table can hold, instead of the 2^31 default
        self.attn[mode].plan(q_lens, kv_lens, page_table, causal=True, max_q_len=max_q_len,
                             max_kv_len=self.spec.max_pages_per_request * self.spec.page_size)

    def write_kv(self, layer, k, v, slots):
        self.caches[layer].append(k, v, slots)

    def attend(self, layer, q):
        return self.attn[self.mode].run(q, self.caches[layer], out=self.out[self.mode][: q.shape[0]])


BACKENDS = {"torch_ref": TorchRefBackend, "cupy_fa": CupyFABackend}


# --------------------------------------------------------------------------------------------
# The model runner: the layers in torch, attention through the backend, eager or CUDA graphs
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class StepInputs:
    """Device inputs of one forward step. For graph modes these are the static tensors of one
    (mode, padded batch size): eager runs and graph replays read the same buffers."""

    tokens: torch.Tensor           # int64 [T]
    positions: torch.Tensor        # int64 [T]
    slots: torch.Tensor            # int64 [T]
    q_lens: torch.Tensor           # int32 [B]
    kv_lens: torch.Tensor          # int32 [B]
    page_table: torch.Tensor       # int32 [B, max_pages_per_request]
    max_q_len: int


@dataclasses.dataclass(frozen=True)
class Shard:
    """Tensor parallelism over attention heads (examples/tp_engine.py runs it): this process is
    rank ``rank`` of ``size``. It holds query heads ``[rank * H_q / size, (rank + 1) * H_q / size)``
    and the matching KV heads of every layer (the q / k / v projections' rows of those heads),
    its own KV cache and attention over them; ``gather`` (an all-gather across the ranks) puts
    the attention outputs back together as ``[T, H_q, D]`` in head order. Every rank then runs the
    same o_proj, MLP, norms and argmax on the same values, so all ranks produce the same tokens
    (the weights of those stay whole on every rank: only attention is split). GQA splits
    cleanly: rank r's query heads read exactly its KV heads. ``size`` 1: the plain engine."""

    rank: int = 0
    size: int = 1
    gather: object = None          # o_local [T, H_q / size, D] -> o [T, H_q, D]; None for size 1

    def heads(self, count, what):
        if count % self.size:
            raise ValueError(f"{what} = {count} does not split over {self.size} tensor-parallel ranks")
        return count // self.size

    def rows(self, count, head_dim, what):
        """The projection rows of this rank's heads among ``count`` heads of ``head_dim``."""
        per = self.heads(count, what) * head_dim
        return slice(self.rank * per, (self.rank + 1) * per)


def _sliced_linear(linear, rows):
    """``linear`` (a torch.nn.Linear) cut to its output rows ``rows``: a callable on activations."""
    weight = linear.weight[rows]
    bias = linear.bias[rows] if linear.bias is not None else None
    return lambda x: torch.nn.functional.linear(x, weight, bias)


class ModelRunner:
    def __init__(self, name, hf_model, backend, pool, *, window, max_batch, use_graphs, shard=Shard()):
        self.name, self.hf, self.backend, self.pool = name, hf_model, backend, pool
        self.window, self.max_batch, self.use_graphs = window, max_batch, use_graphs
        self.shard = shard
        cfg = hf_model.config
        self.projections = []          # per layer: this rank's q, k, v projections
        for layer in hf_model.model.layers:
            a = layer.self_attn
            if shard.size == 1:
                self.projections.append((a.q_proj, a.k_proj, a.v_proj))
                continue
            q_rows = shard.rows(cfg.num_attention_heads, backend.spec.head_dim, "num_attention_heads")
            kv_rows = shard.rows(cfg.num_key_value_heads, backend.spec.head_dim, "num_key_value_heads")
            self.projections.append((_sliced_linear(a.q_proj, q_rows), _sliced_linear(a.k_proj, kv_rows),
                                     _sliced_linear(a.v_proj, kv_rows)))
        spec = backend.spec
        self.device, self.dtype = spec.device, spec.dtype
        self.head_dim, self.max_pages = spec.head_dim, spec.max_pages_per_request
        self.static = {}               # (mode, padded batch) -> StepInputs
        self.graphs = {}               # (mode, padded batch) -> CapturedStep
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
        self.apply_rotary_pos_emb = apply_rotary_pos_emb

    # -- the model ---------------------------------------------------------------------------
    def forward(self, tokens, positions, slots):
        """Logits [T, vocab] of the flattened query tokens. Everything but the K/V write and the
        attention is the HF modules' own math in fp32; q/k/v go to the attention dtype and the
        attention output comes back to fp32. Tensor-parallel (``shard.size > 1``): q/k/v of this
        rank's heads only, attention over its own cache, the outputs all-gathered before o_proj."""
        model, D, T = self.hf.model, self.head_dim, tokens.shape[0]
        x = model.embed_tokens(tokens)
        cos, sin = model.rotary_emb(x, positions[None])
        cos, sin = cos[0], sin[0]
        for i, layer in enumerate(model.layers):
            attn = layer.self_attn
            q_proj, k_proj, v_proj = self.projections[i]
            h = layer.input_layernorm(x)
            q = q_proj(h).view(T, -1, D)
            k = k_proj(h).view(T, -1, D)
            v = v_proj(h).view(T, -1, D)
            q, k = self.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
            self.backend.write_kv(i, k.to(self.dtype), v.to(self.dtype), slots)
            o = self.backend.attend(i, q.to(self.dtype).contiguous())
            if self.shard.size > 1:
                o = self.shard.gather(o)   # [T, H_q / size, D] of every rank -> [T, H_q, D]
            x = x + attn.o_proj(o.float().reshape(T, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.hf.lm_head(model.norm(x))

    def _launch(self, mode, inp: StepInputs):
        self.backend.plan(mode, inp.q_lens, inp.kv_lens, inp.page_table, max_q_len=inp.max_q_len)
        return self.forward(inp.tokens, inp.positions, inp.slots)

    # -- one step ----------------------------------------------------------------------------
    def step(self, mode: Mode, reqs, seqs, cached=None):
        """Run one forward step of ``mode`` for requests ``reqs`` whose sequences (for this
        model) are ``seqs``; ``cached`` (EXTEND only) is each request's cached prefix.
        Returns a list of [q_len, vocab] fp32 logits on the host, one per request."""
        B = len(reqs)
        q_lens, kv_lens, rows = [], [], []
        for i, (r, seq) in enumerate(zip(reqs, seqs)):
            kv = r.kv[self.name]
            q_len, kv_len = mode_lengths(mode, len(seq), cached[i] if cached else 0, self.window)
            start = kv_len - q_len
            assert start <= kv.length, f"{mode.name}: request {r.rid} would attend to unwritten K/V"
            kv.reserve(kv_len)
            rows.append((np.asarray(seq[start:], np.int64), np.arange(start, kv_len), kv.slots(start, kv_len)))
            q_lens.append(q_len)
            kv_lens.append(kv_len)

        if mode.fixed_q_len:
            q = q_lens[0]
            assert all(x == q for x in q_lens), "graph modes have a fixed q_len per request"
            Bp = batch_bucket(B, self.max_batch)
            inp = self._static_inputs(mode, Bp, q)
            self._fill(inp, reqs, rows, q_lens, kv_lens)
            logits = self._run_graph(mode, Bp, inp) if self.use_graphs else self._launch(mode, inp)
        else:
            inp = self._new_inputs(sum(q_lens), B, max(q_lens))
            self._fill(inp, reqs, rows, q_lens, kv_lens)
            logits = self._launch(mode, inp)

        for r, kv_len in zip(reqs, kv_lens):
            r.kv[self.name].length = kv_len
        logits = logits[: sum(q_lens)].float().cpu()
        return list(torch.split(logits, q_lens))

    def _new_inputs(self, T, B, max_q_len):
        def z(*shape, dt):
            return torch.zeros(shape, dtype=dt, device=self.device)

        return StepInputs(z(T, dt=torch.int64), z(T, dt=torch.int64), z(T, dt=torch.int64),
                          z(B, dt=torch.int32), z(B, dt=torch.int32),
                          z(B, self.max_pages, dt=torch.int32), max_q_len)

    def _static_inputs(self, mode, Bp, q):
        key = (mode, Bp)
        if key not in self.static:
            self.static[key] = self._new_inputs(Bp * q, Bp, q)
        return self.static[key]

    def _fill(self, inp: StepInputs, reqs, rows, q_lens, kv_lens):
        """Copy one step's inputs into ``inp``. Rows past the real batch are padding: q_len 0,
        kv_len 0, a page table of the scratch page, and their tokens (after all real tokens)
        write to the scratch page."""
        B, Bp, T = len(reqs), inp.q_lens.shape[0], inp.tokens.shape[0]
        ps = self.pool.page_size
        tokens = np.zeros(T, np.int64)
        positions = np.zeros(T, np.int64)
        slots = PagePool.SCRATCH * ps + np.arange(T, dtype=np.int64) % ps
        n = 0
        for tok, pos, slot in rows:
            tokens[n:n + len(tok)], positions[n:n + len(tok)], slots[n:n + len(tok)] = tok, pos, slot
            n += len(tok)
        page_table = np.full((Bp, self.max_pages), PagePool.SCRATCH, np.int32)
        for b, r in enumerate(reqs):
            pages = r.kv[self.name].pages
            page_table[b, :len(pages)] = pages
        pad = [0] * (Bp - B)
        for dst, src in ((inp.tokens, tokens), (inp.positions, positions), (inp.slots, slots),
                         (inp.q_lens, np.asarray(q_lens + pad, np.int32)),
                         (inp.kv_lens, np.asarray(kv_lens + pad, np.int32)), (inp.page_table, page_table)):
            dst.copy_(torch.from_numpy(src))

    def _run_graph(self, mode, Bp, inp):
        key = (mode, Bp)
        if key not in self.graphs:
            self.graphs[key] = CapturedStep(lambda: self._launch(mode, inp))
            return self.graphs[key].first
        return self.graphs[key].replay()


class CapturedStep:
    """One forward step (plan + all layers over static inputs) as a CUDA graph.

    Construction first runs ``fn`` eagerly on a side stream -- the warm-up: it compiles kernels
    and sets up workspaces, and since it reads the step's real inputs, its output ``first`` is
    that step's result -- then captures ``fn`` (capture does not execute anything). ``replay()``
    reruns the graph on whatever the static inputs hold now and returns the static output.
    """

    def __init__(self, fn):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.first = fn()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = fn()

    def replay(self):
        self.graph.replay()
        return self.out


# --------------------------------------------------------------------------------------------
# The engine: requests, prefill, plain decode, speculative rounds
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Request:
    rid: int
    prompt: list
    budget: int
    kv: dict                       # model name -> SeqKV
    tokens: list = None            # prompt + emitted tokens
    logits: list = None            # target logits row behind each emitted token (fp32, host)
    drafts: list = None            # this round's draft proposals

    def __post_init__(self):
        self.tokens, self.logits, self.drafts = list(self.prompt), [], []

    @property
    def generated(self):
        return self.tokens[len(self.prompt):]

    @property
    def done(self):
        return len(self.tokens) - len(self.prompt) >= self.budget


def _argmax(row) -> int:
    return int(torch.argmax(row))


class Engine:
    def __init__(self, target, draft, args, prompts, budgets, device, shard=Shard()):
        """``shard``: this process's part of a tensor-parallel run (:class:`Shard`); each model's
        cache and attention then hold its heads only."""
        self.args, self.device, self.shard = args, torch.device(device), shard
        self.num_draft = args.num_draft
        self.window = W = args.num_draft + 1
        self.attn_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
        ps = args.page_size
        max_len = max(len(p) for p in prompts) + max(budgets) + 2 * W + 1
        max_pages = math.ceil(max_len / ps)
        num_pages = 1 + len(prompts) * max_pages + 4
        self.max_batch = batch_bucket(len(prompts), 1 << 30)
        prefill_tokens = sum(len(p) + 1 for p in prompts)
        self.runners = {}
        for name, model, modes in (("target", target, (Mode.EXTEND, Mode.DECODE, Mode.TARGET_VERIFY)),
                                   ("draft", draft, (Mode.EXTEND, Mode.DECODE, Mode.DRAFT_EXTEND_V2))):
            cfg = model.config
            q_per_row = {Mode.EXTEND: None, Mode.DECODE: 1, Mode.TARGET_VERIFY: W, Mode.DRAFT_EXTEND_V2: W}
            spec = CacheSpec(
                num_layers=cfg.num_hidden_layers, num_pages=num_pages, page_size=ps,
                num_q_heads=shard.heads(cfg.num_attention_heads, "num_attention_heads"),
                num_kv_heads=shard.heads(cfg.num_key_value_heads, "num_key_value_heads"),
                head_dim=args.head_dim, dtype=self.attn_dtype, device=self.device,
                max_batch=self.max_batch, max_pages_per_request=max_pages,
                max_tokens={m: prefill_tokens if q_per_row[m] is None else self.max_batch * q_per_row[m]
                            for m in modes})
            backend = BACKENDS[args.backend](spec)
            self.runners[name] = ModelRunner(name, model, backend, PagePool(num_pages, ps, 0),
                                             window=W, max_batch=self.max_batch,
                                             use_graphs=args.graphs, shard=shard)
        self.target, self.draft = self.runners["target"], self.runners["draft"]

    # -- public ------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts, budgets, shared, speculative: bool, seed: int = 0):
        """Greedy generation for all prompts in one batch; returns tokens, logits and stats."""
        for i, runner in enumerate(self.runners.values()):
            runner.pool.reset(seed * 7 + i)          # a different page placement every run
        reqs = [Request(i, p, b, {n: SeqKV(r.pool) for n, r in self.runners.items()})
                for i, (p, b) in enumerate(zip(prompts, budgets))]
        self.stats = dict(verify_rows=0, proposed=0, accepted=0, extend_rows=0, extend_agree=0, steps=0)
        self._sync()
        t0 = time.perf_counter()
        self.prefill(self.target, reqs, shared)
        if speculative:
            self.prefill(self.draft, reqs, shared)
        while True:
            live = [r for r in reqs if not r.done]
            if not live:
                break
            if speculative:
                self.spec_round(live)
            else:
                self.decode_step(live)
        self._sync()
        seconds = time.perf_counter() - t0
        return dict(tokens=[r.generated[:r.budget] for r in reqs],
                    logits=[torch.stack(r.logits[:r.budget]) for r in reqs],
                    emitted=sum(len(r.generated) for r in reqs), seconds=seconds,
                    graphs_captured=sum(len(r.graphs) for r in self.runners.values()), **self.stats)

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _emit(self, r, tokens, logits_rows):
        r.tokens.extend(tokens)
        r.logits.extend(logits_rows)

    # -- the three kinds of step ----------------------------------------------------------------
    def prefill(self, runner, reqs, shared):
        """EXTEND. Prompts that borrow another's pages go in a second batch, after the owner's
        prefill, as an extend over the cached prefix. The target prefills the prompt and emits the
        first token; the draft prefills prompt + that token and proposes d1."""
        borrowers = {b: (o, n) for b, o, n in shared}
        for group in ([r for r in reqs if r.rid not in borrowers], [r for r in reqs if r.rid in borrowers]):
            if not group:
                continue
            cached = []
            for r in group:
                if r.rid in borrowers:
                    owner, n = borrowers[r.rid]
                    r.kv[runner.name].borrow_prefix(reqs[owner].kv[runner.name], n)
                cached.append(r.kv[runner.name].length)
            out = runner.step(Mode.EXTEND, group, [r.tokens for r in group], cached)
            for r, logits in zip(group, out):
                if runner is self.target:
                    self._emit(r, [_argmax(logits[-1])], [logits[-1]])
                else:
                    r.drafts = [_argmax(logits[-1])]
            self.stats["steps"] += 1

    def decode_step(self, live):
        """DECODE (plain greedy): the target runs each request's pending token."""
        out = self.target.step(Mode.DECODE, live, [r.tokens for r in live])
        for r, logits in zip(live, out):
            self._emit(r, [_argmax(logits[0])], [logits[0]])
        self.stats["steps"] += 1

    def spec_round(self, live):
        """One chain speculative round: S-1 draft DECODE steps, TARGET_VERIFY, DRAFT_EXTEND_V2."""
        S, W = self.num_draft, self.window
        # 1. draft: d1 is known; d2..dS by S-1 decode steps over the draft's own cache
        for _ in range(S - 1):
            out = self.draft.step(Mode.DECODE, live, [r.tokens + r.drafts for r in live])
            for r, logits in zip(live, out):
                r.drafts.append(_argmax(logits[0]))
            self.stats["steps"] += 1
        # 2. target verify over [x0, d1..dS]
        out = self.target.step(Mode.TARGET_VERIFY, live, [r.tokens + r.drafts for r in live])
        old = {}
        for r, logits in zip(live, out):
            greedy = torch.argmax(logits, dim=-1).tolist()
            A = 0
            while A < S and r.drafts[A] == greedy[A]:
                A += 1
            old[r.rid] = (len(r.tokens), A, r.drafts)
            self._emit(r, r.drafts[:A] + [greedy[A]], list(logits[:A + 1]))
            r.kv["target"].length = len(r.tokens) - 1      # drop the rejected drafts' K/V
            self.stats["verify_rows"] += 1
            self.stats["proposed"] += S
            self.stats["accepted"] += A
        self.stats["steps"] += 1
        # 3. draft extend over the last W tokens, for the requests that go on
        cont = [r for r in live if not r.done]
        if not cont:
            return
        out = self.draft.step(Mode.DRAFT_EXTEND_V2, cont, [r.tokens for r in cont])
        for r, logits in zip(cont, out):
            n, A, drafts = old[r.rid]
            first = len(r.tokens) - W                     # position of the window's row 0
            for i in range(min(A, S - 1) + 1):            # rows whose draft prediction is known
                j = n - 1 + i - first
                if 0 <= j < W:
                    self.stats["extend_rows"] += 1
                    self.stats["extend_agree"] += int(_argmax(logits[j]) == drafts[i])
            r.drafts = [_argmax(logits[-1])]
        self.stats["steps"] += 1


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------


def _margin(row) -> float:
    top = torch.topk(row, 2).values
    return float(top[0] - top[1])


def _first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


@torch.no_grad()
def hf_reference(model, prompts, budgets, device):
    """transformers' own greedy generate (fp32) for each prompt, with its logits per step."""
    out = []
    for p, b in zip(prompts, budgets):
        ids = torch.tensor([p], device=device)
        g = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                           max_new_tokens=b, min_new_tokens=b, output_logits=True,
                           return_dict_in_generate=True, pad_token_id=0)
        out.append((g.sequences[0, len(p):].tolist(), torch.stack(g.logits)[:, 0].float().cpu()))
    return out


@torch.no_grad()
def hf_teacher_forced(model, prompts, generated, device):
    """transformers' fp32 logits along the engine's own token sequence (one full forward each),
    so every engine step is compared, also after a near-tie made the two greedy paths part."""
    out = []
    for p, g in zip(prompts, generated):
        ids = torch.tensor([p + g], device=device)
        logits = model(ids).logits[0].float().cpu()
        out.append(logits[len(p) - 1: len(p) - 1 + len(g)])
    return out


def check_vs_hf(hf, teacher, run, tol):
    """(1) engine greedy tokens vs HF generate. A token may differ only at a numerical near-tie:
    the engine's logits must stay within ``tol`` of HF's fp32 logits at every step (compared along
    the engine's own sequence); where a token differs, the first difference, the HF margin
    (top1 - top2) there and the logit difference there are reported."""
    per = []
    for (hf_tokens, hf_logits), tf_logits, tokens, logits in zip(hf, teacher, run["tokens"], run["logits"]):
        j = _first_diff(tokens, hf_tokens)
        max_diff = float((logits - tf_logits).abs().max())
        rec = dict(identical=j is None, first_diff=j, max_abs_logit_diff=max_diff)
        if j is not None:
            rec.update(hf_token=hf_tokens[j], engine_token=tokens[j], hf_margin=_margin(hf_logits[j]),
                       logit_diff_at_diff=float((logits[j] - hf_logits[j]).abs().max()))
        rec["ok"] = max_diff <= tol
        per.append(rec)
    return dict(ok=all(r["ok"] for r in per), identical=all(r["identical"] for r in per),
                tol=tol, per_request=per)


def check_same(a, b):
    """Identical tokens for every request; where not, the first difference with the margin of
    run a's logits there and the logit difference between the runs at that step."""
    per = []
    for ta, tb, la, lb in zip(a["tokens"], b["tokens"], a["logits"], b["logits"]):
        j = _first_diff(ta, tb)
        n = len(ta) if j is None else j + 1
        rec = dict(identical=j is None and len(ta) == len(tb), first_diff=j,
                   max_abs_logit_diff=float((la[:n] - lb[:n]).abs().max()))
        if j is not None:
            rec.update(margin=_margin(la[j]), logit_diff_at_diff=float((la[j] - lb[j]).abs().max()))
        per.append(rec)
    return dict(ok=all(r["identical"] for r in per), per_request=per)


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------

# Max |engine - HF fp32| logit difference allowed by check (1). The torch_ref backend (fp32 softmax
# over the bf16/fp16 cache) reaches about 0.045 (bf16) and 0.005 (fp16) on the default model.
DEFAULT_LOGIT_TOL = {"bf16": 0.15, "fp16": 0.04}


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16", help="attention / KV cache dtype")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens per request (request i gets 2*i more)")
    p.add_argument("--num-draft", type=int, default=4, help="draft tokens per speculative round (S)")
    p.add_argument("--no-graphs", dest="graphs", action="store_false", help="eager only")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if cuda else "cpu")
    p.add_argument("--backend", choices=tuple(BACKENDS), default=None,
                   help="default: cupy_fa on cuda, torch_ref on cpu")
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("model (random weights)")
    g.add_argument("--vocab", type=int, default=1024)
    g.add_argument("--hidden", type=int, default=512)
    g.add_argument("--intermediate", type=int, default=1024)
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--draft-layers", type=int, default=2)
    g.add_argument("--heads", type=int, default=8)
    g.add_argument("--kv-heads", type=int, default=2)
    g.add_argument("--head-dim", type=int, default=128)
    g.add_argument("--init-std", type=float, default=0.05)
    g.add_argument("--late-layer-scale", type=float, default=0.2,
                   help="scale of the output projections of the layers the draft lacks")
    g = p.add_argument_group("checks")
    g.add_argument("--logit-tol", type=float, default=None,
                   help=f"max |engine - HF| logit difference for check (1); default {DEFAULT_LOGIT_TOL}")
    g.add_argument("--min-extend-consistency", type=float, default=0.95,
                   help="least fraction of DRAFT_EXTEND_V2 rows that must reproduce the draft's own "
                        "earlier predictions")
    g.add_argument("--timing-runs", type=int, default=1,
                   help="timed repeats of each run (after the first, which warms up and captures)")
    args = p.parse_args(argv)
    if args.num_draft < 1 or not 1 <= args.draft_layers <= args.layers or args.heads % args.kv_heads:
        p.error("need --num-draft >= 1, 1 <= --draft-layers <= --layers, --heads divisible by --kv-heads")
    if args.backend is None:
        args.backend = "cupy_fa" if args.device == "cuda" else "torch_ref"
    if args.device == "cpu":
        args.graphs = False
    if args.logit_tol is None:
        args.logit_tol = DEFAULT_LOGIT_TOL[args.dtype]
    return args


def run_all(args, log=print):
    """Run every check; returns a dict of results (``results["ok"]`` is the overall verdict)."""
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    device = torch.device(args.device)
    target, draft = build_models(args, device)
    W = args.num_draft + 1
    prompts, shared = make_prompts(args.vocab, args.page_size, W, args.seed)
    budgets = [args.new_tokens + 2 * i for i in range(len(prompts))]
    log(f"model: {args.layers} layers (draft {args.draft_layers}), hidden {args.hidden}, "
        f"{args.heads} q / {args.kv_heads} kv heads, head_dim {args.head_dim}, vocab {args.vocab}; "
        f"attention {args.dtype} via {args.backend} on {args.device}, page size {args.page_size}")
    log(f"prompts {[len(p) for p in prompts]} (prompt {shared[0][0]} reuses the first {shared[0][2]} "
        f"tokens of prompt {shared[0][1]}), new tokens {budgets}, S = {args.num_draft} drafts (W = {W})")

    results = dict(config=dict(vars(args)), prompt_lens=[len(p) for p in prompts], budgets=budgets)
    graph_settings = [False] + ([True] if args.graphs and device.type == "cuda" else [])
    runs, rerun_same = {}, []
    for graphs in graph_settings:
        run_args = argparse.Namespace(**{**vars(args), "graphs": graphs})
        engine = Engine(target, draft, run_args, prompts, budgets, device)
        for spec in (False, True):
            key = ("spec" if spec else "plain") + ("_graphs" if graphs else "_eager")
            first = engine.generate(prompts, budgets, shared, spec, seed=1)
            timed = [engine.generate(prompts, budgets, shared, spec, seed=2 + k) for k in range(args.timing_runs)]
            for t in timed:
                rerun_same.append((key, check_same(first, t)["ok"]))
            first["tokens_per_s"] = (sum(t["emitted"] for t in timed) / sum(t["seconds"] for t in timed)
                                     if timed else None)
            runs[key] = first

    # (1) plain greedy through the engine vs transformers
    hf = hf_reference(target, prompts, budgets, device)
    teacher = hf_teacher_forced(target, prompts, runs["plain_eager"]["tokens"], device)
    c1 = check_vs_hf(hf, teacher, runs["plain_eager"], args.logit_tol)
    log(f"(1) engine plain greedy vs transformers generate: {'PASS' if c1['ok'] else 'FAIL'}"
        f" ({'all tokens identical' if c1['identical'] else 'near-tie differences'}, logit tol {args.logit_tol})")
    for i, r in enumerate(c1["per_request"]):
        line = f"    request {i}: max |logit diff| {r['max_abs_logit_diff']:.2e}"
        if not r["identical"]:
            line += (f"; first difference at token {r['first_diff']}: HF {r['hf_token']} vs engine "
                     f"{r['engine_token']}, HF margin {r['hf_margin']:.2e}, |logit diff| there "
                     f"{r['logit_diff_at_diff']:.2e}")
        log(line)

    # (2) speculative == plain greedy, in every graph setting
    c2 = {}
    for graphs in graph_settings:
        sfx = "_graphs" if graphs else "_eager"
        c = check_same(runs["plain" + sfx], runs["spec" + sfx])
        s = runs["spec" + sfx]
        c["acceptance_rate"] = s["accepted"] / max(1, s["proposed"])
        c["tokens_per_verify"] = (s["accepted"] + s["verify_rows"]) / max(1, s["verify_rows"])
        c["extend_consistency"] = s["extend_agree"] / max(1, s["extend_rows"])
        c["tokens_identical"] = c["ok"]
        c["ok"] = c["ok"] and c["extend_consistency"] >= args.min_extend_consistency
        c2[sfx[1:]] = c
        log(f"(2) speculative == plain greedy ({sfx[1:]}): {'PASS' if c['ok'] else 'FAIL'}; acceptance "
            f"{c['acceptance_rate']:.2f} ({c['tokens_per_verify']:.2f} tokens per verify), draft-extend "
            f"consistency {s['extend_agree']}/{s['extend_rows']}")
        for i, r in enumerate(c["per_request"]):
            if not r["identical"]:
                log(f"    request {i}: first difference at token {r['first_diff']}, plain margin "
                    f"{r['margin']:.2e}, |logit diff| there {r['logit_diff_at_diff']:.2e}")

    # (3) graphs on vs off (and timed re-runs with another page placement) give the same tokens
    c3 = dict(skipped=len(graph_settings) == 1, rerun_identical=all(ok for _, ok in rerun_same))
    if not c3["skipped"]:
        for kind in ("plain", "spec"):
            c3[kind] = check_same(runs[kind + "_eager"], runs[kind + "_graphs"])
    c3["ok"] = c3["rerun_identical"] and all(c3[k]["ok"] for k in ("plain", "spec") if k in c3)
    log("(3) graphs on vs off: " + ("skipped (no graphs)" if c3["skipped"] else
        ("PASS" if all(c3[k]["ok"] for k in ("plain", "spec")) else "FAIL"))
        + f"; re-runs with other page placements identical: {c3['rerun_identical']}")
    for kind in ("plain", "spec"):
        for i, r in enumerate(c3.get(kind, {}).get("per_request", [])):
            if not r["identical"]:
                log(f"    {kind} request {i}: first difference at token {r['first_diff']}, margin "
                    f"{r['margin']:.2e}, |logit diff| there {r['logit_diff_at_diff']:.2e}")

    # (4) throughput
    tps = {k: v["tokens_per_s"] for k, v in runs.items()}
    log("(4) tokens/s: " + ", ".join(f"{k} {v:.0f}" if v else f"{k} -" for k, v in tps.items()))

    c3["captured"] = {k: v["graphs_captured"] for k, v in runs.items()}
    results.update(hf=c1, spec=c2, graphs=c3, tokens_per_s=tps,
                   tokens={k: v["tokens"] for k, v in runs.items()},
                   hf_tokens=[t for t, _ in hf])
    results["ok"] = c1["ok"] and all(c["ok"] for c in c2.values()) and c3["ok"]
    log("ALL PASS" if results["ok"] else "FAILED")
    return results


def main(argv=None):
    return 0 if run_all(parse_args(argv))["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
