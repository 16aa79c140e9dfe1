"""The cases of SGLang 0.5.17's attention kit (``sglang.test.kits.attention_unittest``) as one table:
``items(backend, config)`` (the dense method) and ``mla_items(backend, config)`` (the MLA method) ->
``[Item]``, each running one kit function on one case.

What runs is what SGLang's own dense test files run for ``triton`` (the kit API of the 0.5.17 wheel):
the eager extend / decode cases (``make_dense_cases``), the interleaved and non-monotonic layouts,
the sliding-window extend cases, CUDA-graph decode, split-op PCG and BCG extend, target verify chain
and tree (eagle, frozen_kv_mtp, dflash, ngram) eager and under CUDA graphs, DRAFT_EXTEND_V2 under
CUDA graphs (fixed tokens, both padding styles, the real EAGLE draft-extend graph runner), and the
EAGLE and Frozen-KV-MTP draft-decode graph runners. A :class:`Config` picks head dim, dtype and page
size (``page=None``: the kit's own pages; ``page=64``: every case at page 64 but the EAGLE tree-draft
runner, which the kit builds at page 1 only).

The MLA method runs the kit's ``TinyDeepseekMLAAttention`` (absorbed MLA over ``MLATokenToKVPool``) at
DeepSeek's latent size, ``kv_lora_rank`` 512 and ``qk_rope_head_dim`` 64 (the kit's default of 32 and
0 is a size no MLA kernel of cupy_fa's takes); the config's head dim plays no part there.
"""

import dataclasses
import unittest

import torch


@dataclasses.dataclass(frozen=True)
class Config:
    head_dim: int = 128
    dtype: str = "float16"
    page: int | None = None
    device: str = "cuda"

    @property
    def label(self):
        return f"d{self.head_dim}-{'fp16' if self.dtype == 'float16' else 'bf16'}-{'kit' if self.page is None else 'p' + str(self.page)}"

    def label_for(self, method):
        return self.label if method == "dense" else f"{method}-{self.label.split('-', 1)[1]}"

    @property
    def kw(self):
        return dict(head_dim=self.head_dim, hidden_size=2 * self.head_dim, dtype=getattr(torch, self.dtype),
                    device=self.device)


@dataclasses.dataclass(frozen=True)
class Item:
    backend: str
    config: Config
    mode: str
    graph: str
    case: str
    run: object  # run(testcase)
    method: str = "dense"

    @property
    def id(self):
        return f"{self.backend}-{self.config.label_for(self.method)}-{self.mode}-{self.case}"


class KitSkipped(AssertionError):
    """The kit declined a case (its ``skipTest``): a failure here, named, never a pytest skip."""


class KitTestCase(unittest.TestCase):
    """The kit wants a unittest.TestCase (assert*, skipTest). A case the kit skips fails with
    :class:`KitSkipped` and the kit's reason: every case we drive must run."""

    __test__ = False

    def runTest(self):  # pragma: no cover
        pass

    def skipTest(self, reason):
        raise KitSkipped(f"the kit skipped this case: {reason}")


def items(backend, config, *, graphs=True):
    """The kit's dense cases for ``backend`` under ``config``; ``graphs=False``: only those that need
    no CUDA (eager, and the metadata-protocol runners that record no graph)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode as M
    from sglang.test.kits.attention_unittest.attention_methods import dense_attention as dense

    def case(name, mode, prefix, extend=(), heads=4, kv=4, page=16, window=None, kit_page_only=False):
        return dense.DenseAttentionCase(name=name, backend=backend, forward_mode=mode, num_heads=heads,
                                        num_kv_heads=kv, page_size=page if kit_page_only else config.page or page,
                                        prefix_lens=prefix, extend_lens=extend, sliding_window_size=window)

    def paged(c):
        return dataclasses.replace(c, page_size=config.page) if config.page else c

    kw = config.kw
    out = []

    def add(mode, graph, name, fn):
        out.append(Item(backend, config, mode, graph, name, fn))

    for c in dense.make_dense_cases(backend):
        c = paged(c)
        add("eager_" + c.forward_mode.name.lower(), "eager", c.name,
            lambda tc, c=c: dense.run_dense_attention_case(tc, c, **kw))
    for c in (case("layout_extend_two_request_ragged", M.EXTEND, (8, 16), (8, 16), 12, 12),
              case("layout_decode_page_boundary", M.DECODE, (15, 16, 17), (), 12, 12)):
        for layout in ("interleaved_pages", "non_monotonic_extend"):
            if layout == "non_monotonic_extend" and c.forward_mode.is_decode():
                continue
            add("layout_" + c.forward_mode.name.lower(), "eager", f"{c.name}[{layout}]",
                lambda tc, c=c, layout=layout: dense.run_dense_attention_case(tc, c, loc_layout=layout, **kw))
    for c in dense.make_swa_no_prefix_input_config_cases(backend) + dense.make_swa_prefix_input_config_cases(backend):
        c = paged(c)
        add("swa_extend", "eager", c.name, lambda tc, c=c: dense.run_dense_attention_case(tc, c, **kw))

    from sglang.test.kits.attention_unittest.runner_modes import cuda_graph_decode_runner as cg
    from sglang.test.kits.attention_unittest.runner_modes import speculative_target_verify_runner as tv

    for c in (case("runner_cuda_graph_decode_page_boundary", M.DECODE, (14, 15, 16)),
              case("runner_cuda_graph_gqa_decode_page_boundary", M.DECODE, (14, 15, 16), (), 4, 2),
              case("runner_cuda_graph_mqa_decode_bsz1", M.DECODE, (7,), (), 4, 1)):
        add("decode", "cg-metadata", c.name, lambda tc, c=c: cg.run_dense_cuda_graph_decode_case(tc, c, **kw))
    spec = (("eagle_verify_chain", 1, "eagle"), ("eagle_verify_tree", 2, "eagle"),
            ("frozen_kv_mtp_verify_chain", 1, "frozen_kv_mtp"), ("dflash_verify_chain", 1, "dflash"),
            ("ngram_verify_chain", 1, "ngram"))
    for name, topk, kind in spec:
        c = case("runner_" + name, M.TARGET_VERIFY, (4, 7), (3, 3))
        add("target_verify", "eager", f"{c.name}[{kind}]",
            lambda tc, c=c, topk=topk, kind=kind: tv.run_dense_spec_verify_case(tc, c, topk=topk, spec_kind=kind, **kw))
    for name, topk, kind in spec:
        c = case("runner_cuda_graph_" + name, M.TARGET_VERIFY, (4, 7), (3, 3))
        add("target_verify", "cg-metadata", f"{c.name}[{kind}]",
            lambda tc, c=c, topk=topk, kind=kind: tv.run_dense_spec_verify_cuda_graph_case(
                tc, c, topk=topk, spec_kind=kind, **kw))

    from sglang.test.kits.attention_unittest.runner_modes import speculative_draft_extend_runner as dx

    c = case("runner_cuda_graph_eagle_draft_extend_v2_fixed_tokens", M.DRAFT_EXTEND_V2, (4, 7), (3, 3))
    for pad in ("small_real", "prod_fill"):
        for bs in (2, 4, 8):
            add("draft_extend_v2", "cg-metadata", f"{c.name}[{pad},bs={bs}]",
                lambda tc, c=c, pad=pad, bs=bs: dx.run_dense_draft_extend_v2_cuda_graph_case(
                    tc, c, cuda_graph_capture_batch_size=bs, pad_style=pad, **kw))
    if not graphs:
        return out

    from sglang.test.kits.attention_unittest.runner_modes import speculative_draft_runner as dr
    from sglang.test.kits.attention_unittest.runner_modes import split_op_runner as so

    for c, tokens in ((case("runner_split_op_mha_extend_ragged_page_boundary", M.EXTEND, (0, 8, 16), (15, 8, 1)), 32),
                      (case("runner_split_op_gqa_extend_cross_page_boundary", M.EXTEND, (15,), (2,), 4, 2), 4)):
        for breakable in (False, True):
            g = "bcg" if breakable else "pcg"
            add("extend", g, f"{c.name}[{g}]", lambda tc, c=c, t=tokens, b=breakable: so.run_dense_split_op_extend_case(
                tc, c, breakable=b, static_num_tokens=t, **kw))
    c = case("runner_eagle_draft_extend_v2_cuda_graph_runner_fixed_tokens", M.DRAFT_EXTEND_V2, (4, 7), (3, 3))
    add("draft_extend_v2", "cuda-graph(EAGLE draft-extend runner)", c.name,
        lambda tc, c=c: dx.run_dense_eagle_draft_extend_v2_cuda_graph_runner_case(tc, c, **kw))
    # the kit builds its EAGLE tree-draft fixture at page 1 only ("branch cache slots are laid out
    # linearly"): that case keeps page 1 in every config
    for name, page, topk, ntok in (("runner_eagle_draft_decode_cuda_graph_chain", 16, 1, 3),
                                   ("runner_eagle_draft_decode_cuda_graph_tree", 1, 2, 4)):
        c = case(name, M.DECODE, (4, 7), (), 4, 4, page, kit_page_only=topk > 1)
        add("draft_decode", "cuda-graph(EAGLE draft runner)", f"{name}[topk={topk}]",
            lambda tc, c=c, topk=topk, ntok=ntok: dr.run_dense_eagle_draft_cuda_graph_runner_case(
                tc, c, topk=topk, speculative_num_draft_tokens=ntok, **kw))
    c = case("runner_frozen_kv_mtp_decode_cuda_graph", M.DECODE, (4, 7))
    add("draft_decode", "cuda-graph(Frozen-KV-MTP runner)", c.name,
        lambda tc, c=c: dr.run_dense_frozen_kv_mtp_cuda_graph_runner_case(tc, c, **kw))
    return out


# DeepSeek V2 / V3 / R1, Kimi K2's latent, at the hidden size SGLang's own tests give the kit for its
# 512-latent backends (flashinfer, flashmla: kv_lora_rank 512, rope 64, hidden 1024). At the kit's
# default hidden size (64) both cupy_fa and SGLang's triton backend failed the EAGLE draft runner's
# chain case alike on an H100 (2026-12-06: max abs error 14-15 and 6-13, a token id's size)
MLA_LATENT = dict(kv_lora_rank=512, qk_rope_head_dim=64, hidden_size=1024)


def mla_items(backend, config, *, graphs=True):
    """The kit's MLA cases for ``backend`` under ``config`` (its dtype, page and device; the latent is
    :data:`MLA_LATENT`); ``graphs=False``: only those that need no CUDA."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode as M
    from sglang.test.kits.attention_unittest.attention_methods import mla_attention as mla
    from sglang.test.kits.attention_unittest.runner_modes import cuda_graph_decode_runner as cg
    from sglang.test.kits.attention_unittest.runner_modes import speculative_draft_extend_runner as dx
    from sglang.test.kits.attention_unittest.runner_modes import speculative_target_verify_runner as tv

    kw = dict(MLA_LATENT, dtype=getattr(torch, config.dtype), device=config.device)
    out = []

    def case(name, mode, prefix, extend=(), page=16):
        return mla.MLAAttentionCase(name=name, backend=backend, forward_mode=mode, num_heads=4,
                                    page_size=config.page or page, prefix_lens=prefix, extend_lens=extend)

    def add(mode, graph, name, fn):
        out.append(Item(backend, config, mode, graph, name, fn, "mla"))

    for c in mla.make_mla_cases(backend):
        c = dataclasses.replace(c, page_size=config.page) if config.page else c
        add("eager_" + c.forward_mode.name.lower(), "eager", c.name, lambda tc, c=c: mla.run_mla_attention_case(tc, c, **kw))
    for c in (case("mla_layout_extend_two_request_ragged", M.EXTEND, (8, 16), (8, 16)),
              case("mla_layout_decode_page_boundary", M.DECODE, (15, 16, 17))):
        for layout in ("interleaved_pages", "non_monotonic_extend")[:1 if c.forward_mode.is_decode() else 2]:
            add("layout_" + c.forward_mode.name.lower(), "eager", f"{c.name}[{layout}]",
                lambda tc, c=c, layout=layout: mla.run_mla_attention_case(tc, c, loc_layout=layout, **kw))
    for c in (case("mla_runner_cuda_graph_decode_page_boundary", M.DECODE, (14, 15, 16)),
              case("mla_runner_cuda_graph_decode_bsz1", M.DECODE, (7,))):
        add("decode", "cg-metadata", c.name, lambda tc, c=c: cg.run_mla_cuda_graph_decode_case(tc, c, **kw))
    for name, topk, kind in (("eagle_verify_chain", 1, "eagle"), ("eagle_verify_tree", 2, "eagle")):
        for graph, prefix, run in (("eager", "mla_runner_", tv.run_mla_eagle_verify_case),
                                   ("cg-metadata", "mla_runner_cuda_graph_", tv.run_mla_eagle_verify_cuda_graph_case)):
            c = case(prefix + name, M.TARGET_VERIFY, (4, 7), (3, 3))
            add("target_verify", graph, f"{c.name}[{kind}]",
                lambda tc, c=c, topk=topk, kind=kind, run=run: run(tc, c, topk=topk, spec_kind=kind, **kw))
    c = case("mla_runner_cuda_graph_draft_extend_v2_fixed_tokens", M.DRAFT_EXTEND_V2, (4, 7), (3, 3))
    for pad in ("small_real", "prod_fill"):
        add("draft_extend_v2", "cg-metadata", f"{c.name}[{pad}]",
            lambda tc, c=c, pad=pad: dx.run_mla_draft_extend_v2_cuda_graph_case(tc, c, pad_style=pad, **kw))
    if not graphs:
        return out

    from sglang.test.kits.attention_unittest.runner_modes import speculative_draft_runner as dr
    from sglang.test.kits.attention_unittest.runner_modes import split_op_runner as so

    c = case("mla_runner_split_op_extend_ragged_page_boundary", M.EXTEND, (0, 8, 16), (15, 8, 1))
    for breakable in (False, True):
        g = "bcg" if breakable else "pcg"
        add("extend", g, f"{c.name}[{g}]", lambda tc, c=c, b=breakable: so.run_mla_split_op_extend_case(
            tc, c, breakable=b, static_num_tokens=32, **kw))
    c = case("mla_runner_eagle_draft_extend_v2_cuda_graph_runner", M.DRAFT_EXTEND_V2, (4, 7), (3, 3))
    add("draft_extend_v2", "cuda-graph(EAGLE draft-extend runner)", c.name,
        lambda tc, c=c: dx.run_mla_eagle_draft_extend_v2_cuda_graph_runner_case(tc, c, **kw))
    c = case("mla_runner_eagle_draft_decode_cuda_graph_chain", M.DECODE, (4, 7))
    add("draft_decode", "cuda-graph(EAGLE draft runner)", c.name,
        lambda tc, c=c: dr.run_mla_eagle_draft_cuda_graph_runner_case(tc, c, **kw))
    return out
