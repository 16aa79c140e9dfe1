"""SGLang's MLA EAGLE draft runner chain case alone, instrumented (2026-12-06).

The kit runs the case twice on fresh fixtures, eagerly and through EAGLEDraftCudaGraphRunner (replayed at
a padded batch), and compares the draft outputs (token ids among them). This records every attention
call's queries and output in both runs, for cupy_fa and for triton, and compares them step by step on the
case's real rows, bit for bit: where the two runs first part says whether attention or the rest of the
runner (embedding, lm_head, top-k at another batch size) makes the difference. Each recorded output is
also held to float64 attention over its request's first seq_len + d cached rows (d = -2 .. 2): the key
count each run's attention actually covered.

    PYTHONPATH=/tmp/sgl-site:$PWD python3 lab/eagle_chain_probe.py [--configs d128-bf16-p64] [--backends cupy_fa,triton]
"""

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)

CASE = "mla_runner_eagle_draft_decode_cuda_graph_chain"


def inputs_text(eager, graph, n):
    """Where the two runs' other attention inputs differ, for the real rows' first n requests."""
    import torch

    if "error" in eager or "error" in graph:
        return f" (inputs not read: {eager.get('error') or graph.get('error')})"
    lens_e, lens_g = eager["seq_lens"][:n].tolist(), graph["seq_lens"][:n].tolist()
    parts = [f"seq_lens {lens_e}" + ("" if lens_e == lens_g else f" != graph {lens_g}")]
    for i, length in enumerate(lens_e[:len(lens_g)]):
        length = min(length, lens_g[i])
        slots_same = bool((eager["slots"][i, :length] == graph["slots"][i, :length]).all())
        a, b = eager["rows"][i, :length].float(), graph["rows"][i, :length].float()
        differ = (a != b).reshape(length, -1).any(dim=1).nonzero().flatten().tolist()
        # the two positions past seq_len (the draft tokens' own rows): their slots and rows in each run
        past = []
        for k in range(length, min(length + 2, eager["slots"].shape[1])):
            se, sg = int(eager["slots"][i, k]), int(graph["slots"][i, k])
            same_row = bool(torch.equal(eager["rows"][i, k], graph["rows"][i, k]))
            past.append(f"key {k}: slot {se}{'' if se == sg else f' / graph {sg}'}, row {'=' if same_row else '!='}")
        parts.append(f"req {i}: slots {'=' if slots_same else '!='}, cache rows differing at keys {differ[:8]}"
                     + (" (" + "; ".join(past) + ")" if past else ""))
    return " [" + "; ".join(parts) + "]"


def reference_lengths(rec, n, deltas=(-2, -1, 0, 1, 2)):
    """Which key count each of the first n requests' outputs match: float64 attention over the
    request's recorded cache rows (its first seq_len + delta slots of req_to_token) for each delta,
    the relative error of the recorded output against each; text like 'req 0: +0 3e-3 (+1 0.4)'."""
    import torch

    seen = rec[4]
    if "error" in seen or not seen.get("heads"):
        return "(no rows)"
    heads, scale = seen["heads"], seen["scaling"]
    q = rec[2][:n].double().reshape(n, heads, -1)
    if "q_rope" in seen:
        q = torch.cat([q, seen["q_rope"][:n].double().reshape(n, heads, -1)], dim=-1)
    out = rec[3][:n].double().reshape(n, heads, -1)
    rows = seen["rows"].double().reshape(seen["rows"].shape[0], seen["rows"].shape[1], -1)
    dv = out.shape[-1]
    parts = []
    for i in range(n):
        length = int(seen["seq_lens"][i])
        errs = {}
        for d in deltas:
            keys = length + d
            if keys < 1 or keys > rows.shape[1]:
                continue
            k = rows[i, :keys, :q.shape[-1]]
            p = torch.softmax(q[i] @ k.T * scale, dim=-1)
            ref = p @ rows[i, :keys, :dv]
            errs[d] = ((out[i] - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        if errs:
            best = min(errs, key=errs.get)
            parts.append(f"req {i}: best {best:+d} {errs[best]:.1e} (" + ", ".join(
                f"{d:+d} {e:.1e}" for d, e in sorted(errs.items()) if d != best) + ")")
    return "; ".join(parts)


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
            layer = a[3] if len(a) > 3 else kw["layer"]
            fb = a[4] if len(a) > 4 else kw["forward_batch"]
            seen = {"scaling": float(getattr(layer, "scaling", 0.0)), "heads": int(getattr(layer, "tp_q_head_num", 0))}
            q_rope = a[6] if len(a) > 6 else kw.get("q_rope")
            if q_rope is not None:  # (the rope part passed apart: q . k takes both)
                seen["q_rope"] = q_rope.detach().clone()
            try:  # what the call writes: the slots and the new rows (k, and k_rope when passed apart)
                seen["loc"] = fb.out_cache_loc.detach().clone()
                k = a[1] if len(a) > 1 else kw.get("k")
                k_rope = a[7] if len(a) > 7 else kw.get("k_rope")
                seen["k"] = None if k is None else k.detach().clone()
                seen["k_rope"] = None if k_rope is None else k_rope.detach().clone()
                seen["written"] = self.token_to_kv_pool.get_key_buffer(layer.layer_id)[fb.out_cache_loc.long()].clone()
            except Exception as exc:  # noqa: BLE001
                seen["write_error"] = repr(exc)[:200]
            try:  # what the call reads besides q (static shapes, so a capture records them too)
                seen["seq_lens"] = fb.seq_lens.detach().clone()
                table = self.req_to_token[fb.req_pool_indices]  # (both backends keep the pool's table)
                seen["slots"] = table.clone()
                seen["rows"] = self.token_to_kv_pool.get_key_buffer(layer.layer_id)[table.long()].clone()
            except Exception as exc:  # noqa: BLE001 (a probe: say what could not be read)
                seen["error"] = repr(exc)[:200]
            records.append((phase[0], q.shape[0], q.detach().clone(), out.detach().clone(), seen))
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
                    line.append(f"step {i}: q {'=' if q_same else f'!= ({dq:.2e})'} out {'=' if o_same else f'!= ({do:.2e})'}"
                                + inputs_text(e[4], g[4], e[1]))
                print(f"   graph captured at {rows} rows: " + "; ".join(line))
                for i, (e, g) in enumerate(zip(eager, same)):  # the slots and rows each call wrote
                    ew, gw = e[4], g[4]
                    text = f"   step {i} writes: loc eager {ew.get('loc', '?').tolist() if 'loc' in ew else ew.get('write_error')}" \
                           f" graph {gw.get('loc', '?').tolist() if 'loc' in gw else gw.get('write_error')}"
                    if "q_rope" in ew and "q_rope" in gw:
                        n = ew["q_rope"].shape[0]
                        text += f"; q_rope real rows equal {[bool(torch.equal(ew['q_rope'][r], gw['q_rope'][r])) for r in range(n)]}"
                    if "written" in ew and "written" in gw:
                        n = ew["written"].shape[0]
                        text += (f"; rows at loc after the call equal "
                                 f"{[bool(torch.equal(ew['written'][r], gw['written'][r])) for r in range(n)]}")
                        for r in range(n):  # which columns of a row that differs (latent 0..511, rope 512..)
                            d = (ew["written"][r].float() - gw["written"][r].float()).abs().flatten()
                            cols = torch.nonzero(d).flatten().tolist()
                            if cols:
                                text += (f"; row {r} differs at {len(cols)} of {d.numel()} columns, "
                                         f"{cols[0]}..{cols[-1]}, max {d.max().item():.3g}")
                    for name in ("k", "k_rope"):
                        ek, gk = ew.get(name), gw.get(name)
                        if ek is not None and gk is not None:
                            n = ek.shape[0]
                            rows = [bool(torch.equal(ek[r], gk[r])) for r in range(n)]
                            text += f"; {name} {tuple(gk.shape)} real rows equal {rows}"
                            if gk.shape[0] > n:
                                text += f", padded rows max abs {gk[n:].float().abs().max().item():.3g}"
                    print(text)
                for i, (e, g) in enumerate(zip(eager, same)):  # which key count each output is attention over
                    print(f"   step {i} keys vs float64: eager {reference_lengths(e, e[1])} | graph "
                          f"{reference_lengths(g, e[1])}")
            for j, (a, e) in enumerate(compared):
                if hasattr(a, 'shape') and a.shape == e.shape:
                    diff = (a.float() - e.float()).abs()
                    print(f"   output {j} {tuple(a.shape)} {a.dtype}: max abs {diff.max().item():.3g}, "
                          f"{int((diff > 0).sum())} of {diff.numel()} differ"
                          + (f"; graph {a.flatten()[:12].tolist()} eager {e.flatten()[:12].tolist()}"
                             if not a.is_floating_point() else ""))


if __name__ == "__main__":
    main()
