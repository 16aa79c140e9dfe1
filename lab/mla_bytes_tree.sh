#!/usr/bin/env bash
# Makes exp/half and exp/noload (lab diagnosis, never the package): copies of HEAD whose seesaw fills
# issue the copies of only the first 2 of each thread's 4 keys (half of every latent block), or none;
# the barriers still complete, S and P V run on what the buffers hold. Timed by lab/probe_mla_bytes.py.
set -eu
for t in half noload; do
  rm -rf exp/$t && mkdir -p exp/$t && git archive HEAD cupy_fa kernels bench | tar -x -C exp/$t
done
python3 - <<'PY'
import re
for tree, keep in (("exp/half", "j < KEYS / 2"), ("exp/noload", "false")):
    p = f"{tree}/kernels/mla/wgmma_copy.cuh"
    s = open(p).read()
    old = "      cp_async_shared(buf_addr + sm90::swizzled_offset<kBlockRows>(key_in0 + 16 * j, 8 * c + chunk), src[j] + c * 128,\n                      valid[j]);"
    assert old in s
    s = s.replace(old, f"      if ({keep}) " + old.lstrip())
    open(p, "w").write(s)
PY
