"""shardzoo's model families: GPT-2, BERT, ViT, OPT, each a plain torch model with its plan.

Each family file writes plain modules and a plan; ``PlannedModel`` (models/planned.py) builds
it whole or as one pipeline stage (``stage=(k, n)``) and splits it over a mesh with the engine
``shardzoo.parallelize`` uses: serial (tp=1) or any tp_mode, with sp and dp; see docs/models.md.
Each model file defines its family's spec (models/spec.py); registering it here is what makes
the family known to Hugging Face loading, checkpoint export, the CLI, the demo and the planner.
``Attention`` and ``MLP`` (models/plain.py) are the blocks the families share, and the ready
blocks for a model of one's own that ``shardzoo.parallelize`` splits with a plan (docs/models.md);
``MoEBlock`` (models/moe.py) a mixture-of-experts block whose experts the plan style 'experts' splits over ep.
"""

from shardzoo.models.bert import BERT, BERT_SPEC, BERTConfig
from shardzoo.models.gpt2 import GPT2, GPT2_SPEC, GPT2Config
from shardzoo.models.moe import MoEBlock, TopKRouter
from shardzoo.models.opt import OPT, OPT_SPEC, OPTConfig
from shardzoo.models.plain import MLP, Attention
from shardzoo.models.spec import FamilySpec, all_specs, register, spec_named, spec_of
from shardzoo.models.vit import ViT, VIT_SPEC, ViTConfig

register(BERT_SPEC)
register(GPT2_SPEC)
register(OPT_SPEC)
register(VIT_SPEC)

__all__ = ["BERT", "BERTConfig", "GPT2", "GPT2Config", "OPT", "OPTConfig", "ViT", "ViTConfig", "Attention", "MLP", "MoEBlock", "TopKRouter",
           "FamilySpec", "all_specs", "register", "spec_named", "spec_of"]
