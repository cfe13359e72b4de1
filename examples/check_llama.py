"""A script for `kp check` (and a model for `kp.optimize`): nox -s demo's Hugging Face Llama.

    kp check examples/check_llama.py                 # every kp candidate on every layer against float64
    kp check examples/check_llama.py --mode infer

On a GPU: 4 layers, 2048 wide, bf16, 4 x 2048 tokens. On a CPU: a tiny one (the kernels run in Triton's
interpreter there, so it stays small).
"""

import torch
import transformers


def build():
    gpu = torch.cuda.is_available()
    size = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=4, num_attention_heads=16)
    if not gpu:
        size = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4)
    config = transformers.LlamaConfig(
        vocab_size=32000 if gpu else 256,
        num_key_value_heads=size["num_attention_heads"] // 4,
        max_position_embeddings=4096,
        attn_implementation="sdpa",
        **size,
    )
    torch.manual_seed(0)
    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
    model = transformers.LlamaForCausalLM(config).to(device, dtype)
    tokens = torch.randint(0, config.vocab_size, (4, 2048) if gpu else (2, 32), device=device)
    return model, (tokens,)
