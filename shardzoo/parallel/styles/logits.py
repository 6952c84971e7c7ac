"""The styles of the model's output: 'lm_head' (the vocabulary-parallel projection, tied to the
'vocab_embedding' layer where the model ties them), 'classifier' (an ``nn.Linear`` onto a few
classes, whose logits every rank holds whole for its batch rows) and 'vocab_bias' (a module
adding a bias [V] of its own to an 'lm_head''s logits: vocab_bias.py).
[b, s, H_l] -> logits [b, s, V_local] / [b, ..., C].
"""

from __future__ import annotations

from torch import nn

from shardzoo.layers.head_1d import Classifier1D, LMHead1D
from shardzoo.layers.head_2d import Classifier2D, LMHead2D
from shardzoo.layers.head_2p5d import Classifier2p5D, LMHead2p5D
from shardzoo.layers.head_3d import Classifier3D, LMHead3D
from shardzoo.parallel.styles.base import Build, Layer, Style, canonical
from shardzoo.parallel.vocab_bias import check_vocab_bias, head_of_bias, install_vocab_bias


class LMHead(Style):
    """Vocabulary-parallel output projection; tied, it shares the built token table's weight."""

    name = "lm_head"
    needs = "an nn.Linear"
    layers = {"1d": Layer(LMHead1D), "2d": Layer(LMHead2D, canonical), "2.5d": Layer(LMHead2p5D, canonical),
              "3d": Layer(LMHead3D, canonical)}

    def accepts(self, module: nn.Module) -> bool:
        return isinstance(module, nn.Linear)

    def build(self, module: nn.Module, ctx: Build) -> nn.Module:
        tied = [n for n, (m, s, _) in ctx.planned.items() if s == "vocab_embedding" and m.weight is module.weight]
        if tied:
            cls, options = self.layers[ctx.mode]
            return cls(module.in_features, module.out_features, False, mesh=ctx.mesh, tie_to=ctx.built[tied[0]],
                       **options(ctx))
        if any(module.weight is m.weight for m, _, _ in ctx.planned.values() if m is not module and hasattr(m, "weight")):
            raise ValueError(f"{ctx.name} shares its weight with a module that is not a 'vocab_embedding' in the plan; "
                             f"plan the token table as 'vocab_embedding' so the head can tie to it")
        return self.layer(module, ctx)


class Classifier(LMHead):
    """Few-class head with full logits in every rank's batch rows (never splits the classes)."""

    name = "classifier"
    layers = {"1d": Layer(Classifier1D), "2d": Layer(Classifier2D, canonical),
              "2.5d": Layer(Classifier2p5D, canonical), "3d": Layer(Classifier3D, canonical)}

    def build(self, module: nn.Module, ctx: Build) -> nn.Module:
        return self.layer(module, ctx)


class VocabBias(Style):
    """A module whose own ``bias`` [V] its forward adds to an 'lm_head''s logits: the bias is
    split like the logits' vocabulary; the module's children are planned on their own."""

    name = "vocab_bias"
    keeps_children = True

    def check(self, name: str, module: nn.Module, pattern: str) -> None:
        check_vocab_bias(name, module, pattern)

    def build(self, module: nn.Module, ctx: Build) -> None:
        head_of_bias(ctx.name, module, ctx.planned)  # raises before anything moves
        return None

    def install(self, module: nn.Module, ctx: Build) -> None:
        head = ctx.model.get_submodule(head_of_bias(ctx.name, module, ctx.planned))
        install_vocab_bias(module, head, ctx.layout)
