"""Any array (NumPy, CuPy, torch, JAX) as a host NumPy array: what every reference takes."""

import numpy as np


def to_numpy(x) -> np.ndarray:
    """Return ``x`` as a host NumPy array (CuPy via ``.get()``, torch via ``.cpu().numpy()``)."""
    if isinstance(x, np.ndarray):
        return x
    if type(x).__module__.split(".")[0] == "torch":
        t = x.detach()
        if str(t.dtype) == "torch.bfloat16":  # NumPy has no bf16 for torch to hand over
            t = t.float()
        return t.cpu().numpy()
    if hasattr(x, "get") and callable(x.get) and not isinstance(x, dict):
        return np.asarray(x.get())  # CuPy
    return np.asarray(x)
