"""examples/tp_engine.py on the CPU: the engine's sharding over attention heads (each rank its
query and KV heads, its own caches, the outputs all-gathered) in two gloo processes, with the
pure-torch attention backend, gives every rank the tokens of one process, plain and speculative.
The same run on two GPUs over NCCL with cupy_fa and graphs: lab/tp_check.sh."""

import sys

import pytest
import torch

from example_engine import ENGINE_PATH, load_engine

pytestmark = pytest.mark.cpu_torch

sys.path.insert(0, str(ENGINE_PATH.parent))  # spawned ranks import tp_engine by name (they inherit sys.path)
import tp_engine  # noqa: E402

engine = load_engine()

TINY = ["--device", "cpu", "--backend", "torch_ref", "--vocab", "256", "--hidden", "128", "--intermediate", "256",
        "--layers", "3", "--draft-layers", "1", "--heads", "4", "--kv-heads", "2", "--head-dim", "32",
        "--new-tokens", "10", "--timing-runs", "0", "--dtype", "fp16", "--page-size", "4", "--num-draft", "3"]


@pytest.fixture(autouse=True)
def one_thread(one_torch_thread):
    """Every test here on one torch thread (conftest.one_torch_thread)."""


def test_two_gloo_ranks_give_the_tokens_of_one():
    lines = []
    result = tp_engine.compare(["--tp", "2"] + TINY, log=lines.append)
    print("\n".join(lines))
    assert result["ok"], "\n".join(lines)
    assert set(result["tp1"]) == {"plain_eager", "spec_eager"}
    for key, base in result["tp1"].items():
        assert all(len(t) > 0 for t in base["tokens"])
        assert [r[key]["tokens"] for r in result["ranks"]] == [base["tokens"]] * 2, key
    assert result["tp1"]["spec_eager"]["tokens"] == result["tp1"]["plain_eager"]["tokens"]


def test_shard_rows_and_gqa_split():
    shard = engine.Shard(1, 2)
    assert shard.heads(8, "h") == 4 and shard.rows(8, 16, "h") == slice(64, 128)
    assert engine.Shard().rows(8, 16, "h") == slice(0, 128)
    # GQA: rank r's query heads read exactly rank r's KV heads (h // group of the whole model)
    for size in (1, 2, 4):
        for rank in range(size):
            s = engine.Shard(rank, size)
            q, kv = s.rows(8, 1, "q"), s.rows(4, 1, "kv")
            assert {h // 2 for h in range(q.start, q.stop)} == set(range(kv.start, kv.stop))
    with pytest.raises(ValueError, match="num_key_value_heads = 2 does not split over 4"):
        engine.Shard(0, 4).heads(2, "num_key_value_heads")
    with pytest.raises(SystemExit):
        tp_engine.parse_args(["--tp", "4"] + TINY)   # 2 KV heads over 4 ranks


def test_sharded_projections_are_the_whole_ones_rows():
    """A rank's q / k / v projections are the rows of its heads of the whole model's."""
    args = engine.parse_args(TINY)
    target, _ = engine.build_models(args, "cpu")
    spec = engine.CacheSpec(num_layers=3, num_pages=4, page_size=4, num_q_heads=2, num_kv_heads=1, head_dim=32,
                            dtype=torch.float16, device=torch.device("cpu"), max_batch=1, max_pages_per_request=2,
                            max_tokens={})
    h = torch.randn(5, 128)
    for rank in (0, 1):
        runner = engine.ModelRunner("target", target, engine.TorchRefBackend(spec), engine.PagePool(4, 4, 0),
                                    window=4, max_batch=1, use_graphs=False, shard=engine.Shard(rank, 2, None))
        for layer, (q, k, v) in zip(target.model.layers, runner.projections):
            a = layer.self_attn
            torch.testing.assert_close(q(h), a.q_proj(h)[:, rank * 64:(rank + 1) * 64], rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(k(h), a.k_proj(h)[:, rank * 32:(rank + 1) * 32], rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(v(h), a.v_proj(h)[:, rank * 32:(rank + 1) * 32], rtol=1e-6, atol=1e-6)


def test_nccl_gather_puts_each_ranks_heads_in_place(monkeypatch):
    """The NCCL form of the gather (one flat all_gather_into_tensor, then heads reordered), with a
    stand-in collective: rank r's heads land at r * H_q / tp, as the gloo form (tested above
    end to end) puts them; inside a capture it uses the captured steps' own communicator."""
    import torch.distributed as dist

    held = [torch.randn(5, 2, 8, dtype=torch.float16) for _ in range(3)]  # what ranks 0, 1, 2 hold
    groups = []

    def all_gather_into_tensor(flat, o, group=None):
        groups.append(group)
        flat.copy_(torch.cat(held, 0))

    monkeypatch.setattr(dist, "all_gather_into_tensor", all_gather_into_tensor)
    capture_group = object()
    gather = tp_engine.head_gather(3, "nccl", capture_group)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert torch.equal(gather(held[1]), torch.cat(held, dim=1))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert torch.equal(gather(held[1]), torch.cat(held, dim=1))
    assert groups == [None, capture_group]
