"""SGLang's MLA EAGLE draft runner chain case alone, instrumented (2026-12-06).

The kit runs the case twice on fresh fixtures, eagerly and through EAGLEDraftCudaGraphRunner (replayed at
a padded batch), and compares the draft outputs (token ids among them). This records every attention
call's queries and output in both runs, for cupy_fa and for triton, and compares them step by step on the
case's real rows, bit for bit: where the two runs first part says whether attention or the rest of the
runner (embedding, lm_head, top-k at another batch size) makes the difference.

    PYTHONPATH=/tmp/sgl-site:$PWD python3 lab/eagle_chain_probe.py [--configs d128-bf16-p64] [--backends cupy_fa,triton]
"""

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)

CASE = "mla_runner_eagle_draft_decode_cuda_graph_chain"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="d128-bf16-p64,d128-fp16-kit")
    ap.add_argument("--backends", default="cupy_fa,triton")
    args = ap.parse_args()
    import torch

    import sglang_harness

    sglang_harness.prepare()
    from sglang_harness import kit_cases
    from sglang_harness.run_kit import parse_config
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    from sglang.test.kits.attention_unittest.runner_modes import speculative_draft_runner as dr

    from cupy_fa.integrations.sglang.backend import CupyFaAttnBackend

    phase = ["setup"]
    records = []

    def recorder(original):
        def wrapped(self, *a, **kw):
            out = original(self, *a, **kw)
            q = a[0] if a else kw["q"]
            records.append((phase[0], q.shape[0], q.detach().clone(), out.detach().clone()))
            return out
        return wrapped

    CupyFaAttnBackend.forward_decode = recorder(CupyFaAttnBackend.forward_decode)
    TritonAttnBackend.forward_decode = recorder(TritonAttnBackend.forward_decode)

    def phased(name, fn):
        def wrapped(*a, **kw):
            phase[0] = name
            try:
                return fn(*a, **kw)
            finally:
                phase[0] = "after " + name
        return wrapped

    dr._run_eagle_draft_eager = phased("eager", dr._run_eagle_draft_eager)
    dr._capture_eagle_draft_graph_runner = phased("capture", dr._capture_eagle_draft_graph_runner)
    executed = []
    orig_execute = dr.EAGLEDraftCudaGraphRunner.execute

    def execute(self, batch):
        result = orig_execute(self, batch)
        torch.cuda.synchronize()
        executed.append(result)
        return result

    dr.EAGLEDraftCudaGraphRunner.execute = execute
    orig_assert = torch.testing.assert_close  # the adapter's comparison calls it once an output
    compared = []

    def assert_close(actual, expected, *a, **kw):
        compared.append((actual, expected))
        return orig_assert(actual, expected, *a, **kw)

    torch.testing.assert_close = assert_close

    for config_text in args.configs.split(","):
        config = parse_config(config_text, "cuda")
        for backend in args.backends.split(","):
            items = [i for i in kit_cases.mla_items(backend, config) if i.case == CASE]
            records.clear(), executed.clear(), compared.clear()
            phase[0] = "setup"
            try:
                items[0].run(kit_cases.KitTestCase())
                result = "PASS"
            except Exception as exc:
                result = f"FAIL {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
            torch.cuda.synchronize()
            print(f"== {backend} {config_text}: {result}")
            eager = [r for r in records if r[0] == "eager"]
            captured = [r for r in records if r[0] == "capture"]
            print(f"   attention calls: eager {len(eager)} (rows {[r[1] for r in eager]}), in capture "
                  f"{len(captured)} (rows {sorted({r[1] for r in captured})})")
            if not eager:
                continue
            # the replayed graph's calls: the last len(eager) captured at the batch the replay padded to
            # (those tensors were written by the replay); the case's real rows come first
            for rows in sorted({r[1] for r in captured}):
                same = [r for r in captured if r[1] == rows][-len(eager):]
                if len(same) < len(eager):
                    continue
                line = []
                for i, (e, g) in enumerate(zip(eager, same)):
                    n = e[1]
                    q_same = torch.equal(e[2], g[2][:n])
                    o_same = torch.equal(e[3], g[3][:n])
                    dq = (e[2].float() - g[2][:n].float()).abs().max().item()
                    do = (e[3].float() - g[3][:n].float()).abs().max().item()
                    line.append(f"step {i}: q {'=' if q_same else f'!= ({dq:.2e})'} out {'=' if o_same else f'!= ({do:.2e})'}")
                print(f"   graph captured at {rows} rows: " + "; ".join(line))
            for j, (a, e) in enumerate(compared):
                if hasattr(a, 'shape') and a.shape == e.shape:
                    diff = (a.float() - e.float()).abs()
                    print(f"   output {j} {tuple(a.shape)} {a.dtype}: max abs {diff.max().item():.3g}, "
                          f"{int((diff > 0).sum())} of {diff.numel()} differ"
                          + (f"; graph {a.flatten()[:12].tolist()} eager {e.flatten()[:12].tolist()}"
                             if not a.is_floating_point() else ""))


if __name__ == "__main__":
    main()
