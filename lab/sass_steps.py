"""SASS instructions per key-tile step of the sm_90a prefill family's consumers (CPU only).

    python lab/sass_steps.py [NAME ...] [--nvrtc] [--ops N] [--list]

NAME: a variant of lab/probe_prefill_sm90.py (VARIANTS; default: the A/B's and the shipped
defaults). Each is compiled for sm_90a with nvcc 13.0 ($NVCC, default
/usr/local/cuda-13.0/bin/nvcc) and the defines NVRTC gets (as scripts/sass_diff.py does), or
with --nvrtc by NVRTC itself (cupy_fa._build.compile_cubin: the binary cupy.RawModule loads on a
device with the same NVRTC), then disassembled by nvdisasm (or cuobjdump; $CUDA_TOOLS_BIN is
searched first, then PATH).

The consumer's main loop is the backward-branch loop holding 16 HGMMA (S = Q K^T of one tile and
P V of the one before, D = 128 / BN = 128). One step is the path through it of a tile that needs
no mask and no O rescale: from the loop head to its backward branch, out-of-line blocks (the
mbarrier retry loops) left out, and the forward branches over a mask block (8 or more FSEL) or
the rescale (16 or more FMUL) taken. Per variant it prints registers / spills (ptxas), the
step's instruction count, the instructions from the first wgmma fence of the step to the last
HGMMA (the issue of the 16 wgmmas), MUFU before / after the P V wait, and the opcode mix.
"""

import argparse
import collections
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
NVCC = os.environ.get("NVCC", "/usr/local/cuda-13.0/bin/nvcc")
FLAGS = ("-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17", "-DCUPY_FA_REQUIRE_SM90A", "-ftz=true",
         "-Xptxas", "-v")

_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s*(.*?)\s*;")
_TARGET = re.compile(r"\bBRA\b[^`]*`?\(?\.?(?:L_x_\d+)?\)?.*?(?:0x([0-9a-f]+))?")


def tool(name):
    for d in filter(None, [os.environ.get("CUDA_TOOLS_BIN")]):
        if (pathlib.Path(d) / name).exists():
            return str(pathlib.Path(d) / name)
    return shutil.which(name)


def disassemble(path):
    """SASS text with addresses and branch targets as addresses (nvdisasm, else cuobjdump)."""
    nvdisasm = tool("nvdisasm")
    if nvdisasm:
        out = subprocess.run([nvdisasm, "-c", "-hex", str(path)], capture_output=True, text=True)
        if out.returncode == 0 and out.stdout:
            return out.stdout
    cuobjdump = tool("cuobjdump")
    if cuobjdump:
        out = subprocess.run([cuobjdump, "--dump-sass", str(path)], capture_output=True, text=True)
        if out.returncode == 0:
            return out.stdout
    raise RuntimeError(f"no disassembler could read {path} (nvdisasm / cuobjdump on PATH or $CUDA_TOOLS_BIN)")


def compile_sass(variant, use_nvrtc):
    """(sass, resources) of a cupy_fa._build.Variant."""
    from cupy_fa import _build

    with tempfile.TemporaryDirectory() as tmp:
        cubin_path = pathlib.Path(tmp) / "prog.cubin"
        if use_nvrtc:
            cubin, res = _build.compile_cubin(variant)
            cubin_path.write_bytes(cubin)  # whole: _build.compile_cubin pads CuPy's short image
        else:
            text = _build.program_text(variant) + f"\nstatic auto cupy_fa_sass_instance = &{variant.expression};\n"
            (pathlib.Path(tmp) / "prog.cu").write_text(text)
            inc = [f"-I{_build.KERNEL_DIR}"] + ([f"-I{os.path.dirname(variant.source)}"]
                                                if os.path.isabs(variant.source) else [])
            run = subprocess.run([NVCC, *FLAGS, *inc, "prog.cu", "-o", "prog.cubin"], cwd=tmp, capture_output=True,
                                 text=True)
            if run.returncode:
                raise RuntimeError(f"nvcc failed on {variant.expression}:\n{run.stderr[-3000:]}")
            log = run.stderr
            regs = re.search(r"Used (\d+) registers", log)
            spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
            res = {"registers": int(regs.group(1)) if regs else None,
                   "spill_stores": int(spill.group(1)) if spill else 0,
                   "spill_loads": int(spill.group(2)) if spill else 0}
        return disassemble(cubin_path), res


def parse(sass):
    """[(address, text)] of the instructions; branch targets resolved to addresses."""
    labels = {}
    ins = []
    pending = []
    for line in sass.splitlines():
        lab = re.match(r"^\s*(\.L_x_\d+):", line)
        if lab:
            pending.append(lab.group(1))
            continue
        m = _LINE.match(line)
        if m:
            addr = int(m.group(1), 16)
            for name in pending:
                labels[name] = addr
            pending = []
            ins.append((addr, m.group(2)))
    return ins, labels


def target_of(text, labels):
    if not re.search(r"\bBRA\b", text):
        return None
    lab = re.search(r"(\.L_x_\d+)", text)
    if lab:
        return labels.get(lab.group(1))
    hexa = re.search(r"0x([0-9a-f]+)", text.split("BRA", 1)[1])
    return int(hexa.group(1), 16) if hexa else None


def opcode(text):
    parts = text.split()
    if parts[0] == "@!PT":
        return "NOP"
    op = parts[1] if parts[0].startswith("@") else parts[0]
    return op.split(".")[0]


def step_path(ins, labels, hgmma_per_step=16):
    """The instructions of one unmasked, non-rescaling step of the consumers' main loop."""
    at = {a: i for i, (a, _) in enumerate(ins)}
    loops = []
    for i, (a, text) in enumerate(ins):
        t = target_of(text, labels)
        if t is not None and t < a and t in at and text.startswith("@"):  # a loop condition (not a retry's way back)
            body = ins[at[t]:i + 1]
            n = sum("HGMMA" in x for _, x in body)
            if n == hgmma_per_step:
                loops.append((at[t], i))
    if not loops:
        return None
    head, tail = max(loops, key=lambda r: r[1] - r[0])  # the outer one (nested retry loops hold no HGMMA)
    path, i = [], head
    while i <= tail:
        a, text = ins[i]
        t = target_of(text, labels)
        if i == tail:
            path.append(text)
            break
        if t is not None:
            conditional = text.startswith("@")
            inside = t in at and head <= at[t] <= tail
            if not inside:  # out of line (retry loops) or the loop's exit: fall through
                path.append(text)
                i += 1
                continue
            j = at[t]
            if j > i:
                skipped = [x for _, x in ins[i + 1:j]]
                ops = collections.Counter(map(opcode, skipped))
                optional = ops["FSEL"] >= 8 or ops["FMUL"] >= 16
                path.append(text)
                if not conditional or optional:
                    i = j
                else:
                    i += 1
                continue
            path.append(text)  # an inner backward branch: not taken
            i += 1
            continue
        path.append(text)
        i += 1
    return path


def producer_tile(ins, labels, copies_per_tile):
    """Instructions per key tile of a producer warp (K and V of one tile): the outer loop that
    holds the cp.async (LDGSTS) copy loops, each inner loop counted as many times as a tile
    needs it (copies_per_tile LDGSTS per thread per K or V tile)."""
    at = {a: i for i, (a, _) in enumerate(ins)}
    loops = []
    for i, (a, text) in enumerate(ins):
        t = target_of(text, labels)
        if t is not None and t < a and t in at and text.startswith("@"):
            body = [x for _, x in ins[at[t]:i + 1]]
            n = sum("LDGSTS" in x for x in body)
            if n:
                loops.append((at[t], i, n))
    if not loops:
        return None
    outer = max(loops, key=lambda r: r[1] - r[0])
    total = outer[1] - outer[0] + 1
    copies = 0
    for head, tail, n in loops:
        if (head, tail) != outer[:2] and outer[0] <= head and tail <= outer[1]:
            trips = max(1, copies_per_tile // n)
            total += (trips - 1) * (tail - head + 1)
            copies += trips * n
    if copies == 0:  # copies unrolled into the outer loop itself
        copies = outer[2]
    return dict(instructions=total, copies=copies)


def summarise(path):
    ops = collections.Counter(map(opcode, path))
    idx = [k for k, x in enumerate(path) if "HGMMA" in x]
    fences = [k for k, x in enumerate(path) if "WARPGROUP.ARRIVE" in x and k < idx[0]]
    issue = idx[-1] - (fences[-1] if fences else idx[0]) + 1
    waits = [k for k, x in enumerate(path) if "WARPGROUP.DEPBAR" in x]
    last_wait = waits[-1] if waits else len(path)
    mufu_before = sum(1 for x in path[:last_wait] if opcode(x) == "MUFU")
    mufu_after = sum(1 for x in path[last_wait:] if opcode(x) == "MUFU")
    return dict(instructions=len(path), issue=issue, mufu=(mufu_before, mufu_after), ops=ops)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("names", nargs="*")
    ap.add_argument("--nvrtc", action="store_true", help="compile with NVRTC (cupy_fa._build.compile_cubin)")
    ap.add_argument("--ops", type=int, default=14, help="opcodes shown per variant")
    ap.add_argument("--list", action="store_true", help="print the step's instructions too")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "lab"))
    import probe_prefill_sm90 as probe

    names = args.names or list(dict.fromkeys(probe.AB_NAMES + probe.DEFAULTS))
    for name in names:
        v = probe.kernel_variant(name)
        sass, res = compile_sass(v, args.nvrtc)
        ins, labels = parse(sass)
        d = probe.VARIANTS[name][1]
        per_step = d.head_dim // 16 + d.block_n // 16
        path = step_path(ins, labels, per_step)
        head = (f"{name:14s} regs {res['registers']} spills {res['spill_stores']}/{res['spill_loads']} "
                f"HGMMA {sum('HGMMA' in x for _, x in ins)}")
        if path is None:
            print(f"{head}: no loop of {per_step} HGMMA found")
            continue
        s = summarise(path)
        mix = " ".join(f"{op} {n}" for op, n in s["ops"].most_common(args.ops))
        prod = producer_tile(ins, labels, d.block_n * d.head_dim // 8 // 128)
        prod_text = (f"producer {prod['instructions']} instructions per tile ({prod['copies']} cp.async)"
                     if prod else "producer loop not found")
        print(f"{head}: step {s['instructions']} instructions, wgmma issue {s['issue']}, "
              f"MUFU before/after the last wait {s['mufu'][0]}/{s['mufu'][1]}; {prod_text}\n    {mix}")
        if args.list:
            for x in path:
                print("      " + x)


if __name__ == "__main__":
    sys.exit(main())
