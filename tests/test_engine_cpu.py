"""examples/engine.py on CPU with the pure-torch attention backend (no GPU, no cupy).

Checks the serving loop itself -- paged KV bookkeeping, the forward-mode metadata, chain
speculative decoding, padding of graph-mode batches -- against transformers. The same
``run_all`` runs with the cupy_fa backend on a GPU in tests/test_engine_gpu.py.
"""

import pytest
import torch

from example_engine import load_engine

# Runs in the torch venv of `make test` (.venv-torch): the package's own venv never holds torch.
pytestmark = pytest.mark.cpu_torch

engine = load_engine()

TINY = ["--device", "cpu", "--backend", "torch_ref", "--vocab", "256", "--hidden", "128",
        "--intermediate", "256", "--layers", "3", "--draft-layers", "1", "--heads", "4",
        "--kv-heads", "2", "--head-dim", "32", "--new-tokens", "12", "--timing-runs", "0"]


@pytest.fixture(autouse=True)
def one_thread(one_torch_thread):
    """Every test here on one torch thread (conftest.one_torch_thread)."""


def run(*extra):
    return engine.run_all(engine.parse_args(TINY + list(extra)), log=lambda *a: None)


@pytest.mark.parametrize("dtype,page_size,num_draft", [("fp16", 4, 3), ("fp16", 1, 1), ("bf16", 16, 2)])
def test_greedy_matches_hf_and_speculative_matches_greedy(dtype, page_size, num_draft):
    r = run("--dtype", dtype, "--page-size", str(page_size), "--num-draft", str(num_draft))
    plain, spec = r["tokens"]["plain_eager"], r["tokens"]["spec_eager"]
    # (1) plain greedy through the engine == transformers generate (fp32), logits within tolerance
    if dtype == "fp16":
        assert plain == r["hf_tokens"]
    assert r["hf"]["ok"], r["hf"]
    assert all(x["max_abs_logit_diff"] < r["hf"]["tol"] for x in r["hf"]["per_request"])
    # (2) speculative == plain greedy, drafts accepted, draft-extend rows consistent
    assert spec == plain
    s = r["spec"]["eager"]
    assert s["ok"] and s["tokens_identical"], s
    assert s["acceptance_rate"] > 0.1
    assert s["extend_consistency"] == 1.0
    # (3) no graphs on CPU; re-runs with another page placement give the same tokens
    assert r["graphs"]["skipped"] and r["graphs"]["rerun_identical"]
    assert r["ok"]
    assert [len(t) for t in plain] == r["budgets"]


def test_shared_prefix_and_staggered_budgets():
    r = run("--page-size", "8", "--timing-runs", "1")
    lens, budgets = r["prompt_lens"], r["budgets"]
    assert len(set(lens)) == len(lens) and len(set(budgets)) == len(budgets)
    assert r["graphs"]["rerun_identical"] and r["ok"]


def test_mode_lengths_follow_design_table():
    M, W = engine.Mode, 5
    assert engine.mode_lengths(M.EXTEND, 40, 0, W) == (40, 40)
    assert engine.mode_lengths(M.EXTEND, 38, 32, W) == (6, 38)          # extend over a cached prefix
    assert engine.mode_lengths(M.DECODE, 41, 0, W) == (1, 41)
    assert engine.mode_lengths(M.TARGET_VERIFY, 45, 0, W) == (5, 45)    # P = 40, kv_len = P + W
    assert engine.mode_lengths(M.DRAFT_EXTEND_V2, 44, 0, W) == (5, 44)  # fixed window, kv_len = P + W
    with pytest.raises(ValueError):
        engine.mode_lengths(M.TARGET_VERIFY, 3, 0, W)
    assert [engine.batch_bucket(b, 4) for b in (1, 2, 3, 4)] == [1, 2, 4, 4]


def test_torch_ref_backend_matches_dense_attention_with_padded_rows():
    torch.manual_seed(0)
    ps, hq, hkv, d, pages = 4, 4, 2, 16, 12
    spec = engine.CacheSpec(num_layers=1, num_pages=pages, page_size=ps, num_q_heads=hq,
                            num_kv_heads=hkv, head_dim=d, dtype=torch.float32, device=torch.device("cpu"),
                            max_batch=3, max_pages_per_request=4, max_tokens={})
    be = engine.TorchRefBackend(spec)
    q_lens, kv_lens = [3, 1, 0], [7, 5, 0]                              # last row is padding
    tables = [[5, 2, 9, 0], [7, 3, 0, 0], [0, 0, 0, 0]]
    ks = [torch.randn(n, hkv, d) for n in kv_lens]
    vs = [torch.randn(n, hkv, d) for n in kv_lens]
    for b in range(2):
        slots = torch.tensor([tables[b][p // ps] * ps + p % ps for p in range(kv_lens[b])])
        be.write_kv(0, ks[b], vs[b], slots)
    q = torch.randn(sum(q_lens) + 2, hq, d)                             # 2 padded query rows
    be.plan(engine.Mode.EXTEND, torch.tensor(q_lens, dtype=torch.int32),
            torch.tensor(kv_lens, dtype=torch.int32), torch.tensor(tables, dtype=torch.int32), 3)
    out = be.attend(0, q)
    row = 0
    for b in range(2):
        k = ks[b].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        v = vs[b].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        qb = q[row:row + q_lens[b]].transpose(0, 1)
        start = kv_lens[b] - q_lens[b]
        mask = torch.arange(kv_lens[b])[None, :] <= (start + torch.arange(q_lens[b]))[:, None]
        ref = torch.nn.functional.scaled_dot_product_attention(qb, k, v, attn_mask=mask).transpose(0, 1)
        torch.testing.assert_close(out[row:row + q_lens[b]], ref, rtol=1e-5, atol=1e-5)
        row += q_lens[b]
    assert torch.all(out[row:] == 0)


def test_no_write_into_shared_pages():
    pool = engine.PagePool(num_pages=8, page_size=4, seed=0)
    owner, borrower = engine.SeqKV(pool), engine.SeqKV(pool)
    owner.reserve(10)
    owner.length = 10
    borrower.borrow_prefix(owner, 8)
    borrower.reserve(12)
    borrower.slots(8, 12)                                                # its own page: fine
    with pytest.raises(AssertionError):
        borrower.slots(7, 12)                                            # position 7 is shared
    with pytest.raises(AssertionError):
        owner.slots(4, 6)


def test_checks_catch_a_draft_extend_that_misses_its_own_kv(monkeypatch):
    """The seed regression (docs/design.md, "Forward modes"): DRAFT_EXTEND_V2 planned with kv_len = prefix
    only. Speculative output stays correct (the target verifies), so only the draft-extend
    consistency check can see it -- it must."""
    plan = engine.TorchRefBackend.plan

    def prefix_only(self, mode, q_lens, kv_lens, page_table, max_q_len):
        if mode is engine.Mode.DRAFT_EXTEND_V2:
            kv_lens = kv_lens - q_lens
        return plan(self, mode, q_lens, kv_lens, page_table, max_q_len)

    monkeypatch.setattr(engine.TorchRefBackend, "plan", prefix_only)
    r = run("--dtype", "fp16", "--page-size", "4", "--num-draft", "3", "--new-tokens", "20")
    assert r["tokens"]["spec_eager"] == r["tokens"]["plain_eager"]
    assert r["spec"]["eager"]["extend_consistency"] < 0.95
    assert not r["ok"]


def test_graph_path_bookkeeping_with_a_stand_in_graph(monkeypatch):
    """The graphs-on path (static buffers per (mode, padded batch), warm-up result first, replays
    after) with a stand-in for the CUDA graph that reruns the step function over the static
    inputs. Only the CUDA calls themselves are left to the GPU test."""

    class StandInGraph:
        captured = 0

        def __init__(self, fn):
            StandInGraph.captured += 1
            self.fn, self.first = fn, fn()
            self.out = torch.empty_like(self.first)

        def replay(self):
            return self.out.copy_(self.fn())

    monkeypatch.setattr(engine, "CapturedStep", StandInGraph)
    args = engine.parse_args(TINY + ["--page-size", "4", "--num-draft", "3"])
    target, draft = engine.build_models(args, "cpu")
    prompts, shared = engine.make_prompts(args.vocab, args.page_size, args.num_draft + 1, args.seed)
    budgets = [args.new_tokens + 2 * i for i in range(len(prompts))]
    out = {}
    for graphs in (False, True):
        args.graphs = graphs
        e = engine.Engine(target, draft, args, prompts, budgets, "cpu")
        for spec in (False, True):
            out[graphs, spec] = e.generate(prompts, budgets, shared, spec, seed=1)
            again = e.generate(prompts, budgets, shared, spec, seed=2)       # replays only
            assert again["tokens"] == out[graphs, spec]["tokens"]
    assert out[True, False]["tokens"] == out[False, False]["tokens"] == out[True, True]["tokens"]
    assert out[True, True]["tokens"] == out[False, True]["tokens"]
    # plain: target DECODE at padded batch 4 (4 and 3 live requests), 2 and 1;
    # speculative adds draft DECODE, TARGET_VERIFY, DRAFT_EXTEND_V2 at the sizes that occurred
    assert out[True, False]["graphs_captured"] == 3
    assert out[True, True]["graphs_captured"] > 3
    assert out[False, True]["graphs_captured"] == 0
    assert StandInGraph.captured == out[True, True]["graphs_captured"]
