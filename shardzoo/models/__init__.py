"""Models written from shardzoo layers on an explicit mesh: GPT-2, BERT, ViT, OPT.

Each builds whole or as one pipeline stage (``stage=(k, n)``) and runs serial (tp=1) or in any
tp_mode, with sp and dp; see docs/models.md.
"""

from shardzoo.models import families  # noqa: F401  (registers the families' checkpoint export adapters)
from shardzoo.models.bert import BERT, BERTConfig
from shardzoo.models.gpt2 import GPT2, GPT2Config
from shardzoo.models.opt import OPT, OPTConfig
from shardzoo.models.vit import ViT, ViTConfig

__all__ = ["BERT", "BERTConfig", "GPT2", "GPT2Config", "OPT", "OPTConfig", "ViT", "ViTConfig"]
