"""The example engine (examples/engine.py) on the GPU through cupy_fa: greedy vs
transformers, speculative == greedy, graphs on == off."""

import pytest

from example_engine import load_engine


@pytest.mark.gpu
@pytest.mark.parametrize("flags", [
    ["--dtype", "bf16", "--page-size", "16", "--num-draft", "4"],
    ["--dtype", "fp16", "--page-size", "1", "--num-draft", "6"],
], ids=["bf16-page16-n4", "fp16-page1-n6"])
def test_engine_on_cupy_fa(flags):
    engine = load_engine()
    args = engine.parse_args(["--device", "cuda", "--backend", "cupy_fa", "--new-tokens", "64",
                              "--timing-runs", "0"] + flags)
    lines = []
    result = engine.run_all(args, log=lines.append)
    print("\n".join(str(x) for x in lines))
    assert result["ok"], "\n".join(str(x) for x in lines[-30:])
    assert not result["graphs"]["skipped"]
    assert result["graphs"]["captured"]["plain_graphs"] > 0
