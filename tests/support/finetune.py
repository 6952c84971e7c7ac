"""A tiny transformers Llama saved the way users keep one (``save_pretrained``), and batches for
the fine-tuning tests (tests/parallel/test_finetune*.py): load it with
``shardzoo.from_pretrained(dir, mesh)``, compare against the serial model read back by
transformers itself.

transformers is imported only inside the builders.
"""

from __future__ import annotations

import torch

VOCAB, SEQ = 128, 12


def tiny_llama(seed: int = 0):
    """A ``LlamaForCausalLM``: hidden 32, 2 layers, 4 heads, 2 kv heads, vocab 128 (fp32, eval)."""
    import transformers

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                      max_position_embeddings=64, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).float().eval()


def save_tiny_llama(model_dir: str, seed: int = 0) -> str:
    """``tiny_llama(seed).save_pretrained(model_dir)``; returns ``model_dir``."""
    tiny_llama(seed).save_pretrained(model_dir)
    return model_dir


def load_serial(model_dir: str):
    """The serial model as transformers reads ``model_dir`` (fp32, eval)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir).float().eval()


def batch(rows: int = 4, seed: int = 0, pad: tuple[int, ...] = (0, 3, 0, 5)):
    """(input_ids, attention_mask, labels) [rows, SEQ]: row i right-padded by ``pad[i % len]``
    positions (labels -100 there)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    mask = torch.ones(rows, SEQ, dtype=torch.long)
    for i in range(rows):
        p = pad[i % len(pad)]
        if p:
            mask[i, SEQ - p:] = 0
    return ids, mask, ids.masked_fill(mask == 0, -100)
