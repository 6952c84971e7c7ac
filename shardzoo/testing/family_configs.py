"""Config dicts of tiny models of each family (gpt2, opt, bert, vit), for the planner tests."""


def config_of(family: str, layers: int, vocab: int, ffn: int, dropout: float) -> dict:
    """The config dict (the family's own field names) of a tiny ``family`` model: width 16, 4 heads,
    16 positions (ViT: 8x8 images in 4x4 patches, 3 labels), ``layers`` blocks, ``vocab`` tokens, an
    ``ffn``-wide MLP and ``dropout`` everywhere."""
    h, heads = 16, 4
    return {
        "gpt2": dict(n_layer=layers, n_embd=h, n_head=heads, n_inner=ffn, vocab_size=vocab, n_positions=16,
                     resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout),
        "opt": dict(num_hidden_layers=layers, hidden_size=h, num_attention_heads=heads, ffn_dim=ffn, vocab_size=vocab,
                    max_position_embeddings=16, dropout=dropout, attention_dropout=dropout),
        "bert": dict(num_hidden_layers=layers, hidden_size=h, num_attention_heads=heads, intermediate_size=ffn,
                     vocab_size=vocab, max_position_embeddings=16, hidden_dropout_prob=dropout,
                     attention_probs_dropout_prob=dropout),
        "vit": dict(num_hidden_layers=layers, hidden_size=h, num_attention_heads=heads, intermediate_size=ffn,
                    image_size=8, patch_size=4, num_labels=3, hidden_dropout_prob=dropout,
                    attention_probs_dropout_prob=dropout),
    }[family]
