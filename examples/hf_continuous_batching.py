"""transformers' continuous batching (generate_batch) on cupy_fa's paged attention.

A random model of Llama-3.2-1B's shape (4 of its 16 layers) is built in code, so nothing is
downloaded; for a real one: AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16,
device_map="cuda", attn_implementation="paged|cupy_fa").   PYTHONPATH=. python examples/hf_continuous_batching.py
"""
import sys

try:
    import torch
    import transformers
except ImportError as e:  # one line, not a traceback
    sys.exit(f"examples/hf_continuous_batching.py needs torch and transformers: {e}")

import cupy_fa.integrations.transformers as cupy_fa_hf
from cupy_fa import _arrays

problem = _arrays.cuda_problem() or (None if torch.cuda.is_available() else f"this torch ({torch.__version__}) "
                                                                             f"sees no CUDA device")
if problem is not None:  # one line, not a traceback from deep inside torch
    sys.exit(f"examples/hf_continuous_batching.py needs a GPU: {problem}")

cupy_fa_hf.register()  # adds "paged|cupy_fa" (continuous batching) and "cupy_fa" (generate)
config = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=4,
                                  num_attention_heads=32, num_key_value_heads=8, head_dim=64)
with torch.device("cuda"):
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                          attn_implementation="paged|cupy_fa").eval()
prompts = [torch.randint(1, config.vocab_size, (n,)).tolist() for n in (5, 40, 130, 300, 7, 64, 256, 1)]
generation = transformers.GenerationConfig(max_new_tokens=64, do_sample=False, eos_token_id=None, pad_token_id=0)
for request_id, output in model.generate_batch(prompts, generation_config=generation).items():
    print(f"{request_id}: {len(output.prompt_ids):3d} prompt tokens -> {len(output.generated_tokens)} new, "
          f"{output.generated_tokens[:6]} ... {output.error or ''}")
