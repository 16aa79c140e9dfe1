"""EAGLE's draft workers on cupy_fa: the multi-step draft-decode backend, and the hook that lets
SGLang 0.5.17's ``DraftBackendFactory`` pick ``"cupy_fa"``.

Multi-step draft decode: each of the ``speculative_num_steps - 1`` draft steps decodes one token per
(request, branch) row, ``bs * topk`` rows; step i reads the request's prefix and the branch's first
i + 1 drafts. The rows' page table is built once per draft round (:func:`.metadata.draft_decode_page_table`)
and each step has its own backend (its own plans: the lengths differ), as SGLang's runners expect
(``attn_backends[i]``).

The hook: SGLang 0.5.17 keeps the draft backends in closed maps inside
``DraftBackendFactory.create_decode_backend`` / ``create_draft_extend_backend`` and raises
"EAGLE is not supported in ... attention backend cupy_fa" for any other name. :func:`install_draft_hook`
puts an AROUND hook (SGLang's own plugin ``HookRegistry``) on ``DraftBackendFactory._create_backend``,
the one method both maps pass through, that adds the ``"cupy_fa"`` entry to the map it is given and
changes nothing else (every other backend name resolves exactly as before). A later SGLang with an
open draft-backend registry needs none of this: ``register()`` would register the two factories
(:class:`CupyFaMultiStepDraftBackend` and ``CupyFaAttnBackend``) under ``"cupy_fa"`` there instead.
"""

import torch

from .backend import CupyFaAttnBackend, Step
from .metadata import ForwardMode, draft_decode_page_table

NAME = "cupy_fa"
HOOK_TARGET = "sglang.srt.speculative.draft_utils.DraftBackendFactory._create_backend"


class CupyFaMultiStepDraftBackend:
    """``speculative_num_steps - 1`` :class:`CupyFaAttnBackend` steps over one draft page table."""

    needs_cpu_seq_lens = False

    def __init__(self, model_runner, topk, speculative_num_steps):
        self.topk, self.speculative_num_steps = int(topk), int(speculative_num_steps)
        self.attn_backends = [CupyFaAttnBackend(model_runner, skip_prefill=True)
                              for _ in range(max(self.speculative_num_steps - 1, 1))]
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.page_size = model_runner.page_size
        self.device = torch.device(model_runner.device)
        self._table = None  # the CUDA-graph page table [max_bs * topk, width]

    def _steps(self, fb, graph):
        bs = int(fb.batch_size)
        rows = bs * self.topk
        width = self.req_to_token.shape[1]
        seq = fb.seq_lens[:bs]
        seq_cpu = getattr(fb, "seq_lens_cpu", None)
        steps = self.speculative_num_steps
        columns = width
        if seq_cpu is not None and len(seq_cpu[:bs]):
            columns = min(int(seq_cpu[:bs].max()) + steps, width)
        table = draft_decode_page_table(self.req_to_token, fb.req_pool_indices[:bs], seq, topk=self.topk,
                                        num_steps=steps, page_size=self.page_size, columns=columns,
                                        out=self._table if graph else None)
        branch_seq = seq.to(torch.int32).repeat_interleave(self.topk)
        for i, backend in enumerate(self.attn_backends):
            kv = branch_seq + (i + 1)
            q = torch.ones_like(kv)
            if graph:
                g = backend._graph_state
                g["q_lens"][:rows].copy_(q)
                g["kv_lens"][:rows].copy_(kv)
                q, kv = g["q_lens"][:rows], g["kv_lens"][:rows]
            max_kv = width if graph else columns
            backend.set_step(Step(ForwardMode.DECODE, q, kv, table, 1, max_kv, None, graph))

    def init_forward_metadata(self, forward_batch):
        self._steps(forward_batch, graph=False)

    def init_cuda_graph_state(self, max_bs, max_num_tokens):
        rows = max(int(max_bs) * self.topk, int(max_num_tokens))
        for backend in self.attn_backends:
            backend.init_cuda_graph_state(rows, max(int(max_num_tokens), rows))
        self._table = torch.zeros(rows, self.req_to_token.shape[1], dtype=torch.int32, device=self.device)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        self._steps(forward_batch, graph=True)

    def init_forward_metadata_in_graph(self, forward_batch):
        for backend in self.attn_backends:
            backend.init_forward_metadata_in_graph(forward_batch)

    def get_cuda_graph_seq_len_fill_value(self):
        return self.attn_backends[0].get_cuda_graph_seq_len_fill_value()

    def on_after_cuda_graph_warmup(self):
        for backend in self.attn_backends:
            backend.on_after_cuda_graph_warmup()


def _around_create_backend(original, factory, backend_name, backend_map, error_template):
    """The hook: ``"cupy_fa"`` joins whichever map (decode or draft extend) is being resolved."""
    from sglang.srt.speculative.draft_utils import DraftBackendFactory

    decode = getattr(backend_map.get("triton"), "__func__", None) is DraftBackendFactory._create_triton_decode_backend
    if decode:
        entry = lambda: CupyFaMultiStepDraftBackend(factory.draft_model_runner, factory.topk,  # noqa: E731
                                                    factory.speculative_num_steps)
    else:
        entry = lambda: CupyFaAttnBackend(factory.draft_model_runner, skip_prefill=False)  # noqa: E731
    return original(factory, backend_name, {**backend_map, NAME: entry}, error_template)


_installed = False


def install_draft_hook():
    """Registers the AROUND hook with SGLang's ``HookRegistry`` (idempotent). Under SGLang's
    ``load_plugins()`` the registry applies it with every plugin's hooks; called on its own (tests,
    scripts) it is applied here."""
    global _installed
    if _installed:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType, _current_plugin_source

    HookRegistry.register(HOOK_TARGET, _around_create_backend, HookType.AROUND)
    if _current_plugin_source.get() is None:  # not inside load_plugins(): nothing else will apply it
        HookRegistry.apply_hooks()
    _installed = True

