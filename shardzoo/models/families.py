"""The model families and how their Hugging Face checkpoints are laid out.

Each family's parameter names follow one Hugging Face class (``architecture``) outside the
blocks; that class's checkpoint keys are the *canonical* names here. Checkpoints of the bare
base model (``GPT2Model``, ``BertModel``, ``ViTModel``, ``OPTModel``) lack the ``base_prefix``;
old BERT checkpoints name LayerNorm parameters ``gamma`` / ``beta``. :meth:`Family.canonical`
maps any of these keys to the canonical name.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardzoo.checkpoint.adapters import ExportAdapter, register_export_adapter

_LEGACY_SUFFIXES = {".gamma": ".weight", ".beta": ".bias"}


@dataclass(frozen=True)
class Family:
    """One model family.

    Attributes:
        name: shardzoo's name ("gpt2", "bert", "vit", "opt").
        model_type: the ``model_type`` of its Hugging Face config.json.
        architecture: the Hugging Face class whose checkpoint keys the model's names follow.
        base_prefix: the prefix of the base model's keys in that class ("transformer.").
        head_prefixes: keys outside the base model (heads), never prefixed.
        module: the module defining the model, its config and ``hf_to_shardzoo`` /
            ``shardzoo_to_hf`` (one full-size tensor at a time).
        model_class, config_class: names in ``module``.
        optional_prefixes: model tensors that checkpoints of ``architecture`` may lack (BERT's
            pooler: ``BertForMaskedLM`` has none); left as initialised and reported in
            ``missing_keys``, but not an error with ``strict``.
    """

    name: str
    model_type: str
    architecture: str
    base_prefix: str
    head_prefixes: tuple[str, ...]
    module: str
    model_class: str
    config_class: str
    optional_prefixes: tuple[str, ...] = ()

    @property
    def code(self):
        """The family's module (imported on first use: the model modules import this one)."""
        return _family_modules()[self.module]

    @property
    def model(self):
        return getattr(self.code, self.model_class)

    @property
    def config(self):
        return getattr(self.code, self.config_class)

    def canonical(self, key: str) -> str:
        """A checkpoint key of any supported variant -> the name in ``architecture``'s checkpoint."""
        for old, new in _LEGACY_SUFFIXES.items():
            if key.endswith(old):
                key = key[: -len(old)] + new
        if key.startswith(self.base_prefix) or key.startswith(self.head_prefixes):
            return key
        return self.base_prefix + key

    def hf_config(self, config) -> dict:
        """config.json contents for ``config`` (a shardzoo config dataclass)."""
        data = config.to_dict()
        data.update(model_type=self.model_type, architectures=[self.architecture])
        return data

    def config_from_json(self, data: dict):
        """A saved config dict -> this family's config (CheckpointError naming the bad field)."""
        return self.config.from_json(data)

    def to_hf(self, name: str, tensor, config) -> list:
        """One saved (shardzoo-named, full-size) tensor -> its Hugging Face ``[(name, tensor)]``."""
        return self.code.shardzoo_to_hf(name, tensor, config=config)

    def export_adapter(self) -> ExportAdapter:
        """What ``checkpoint.export_plain`` needs to give this family's checkpoints Hugging Face
        names and config.json (registered for every family when this module is imported)."""
        return ExportAdapter(config_class=f"{self.module}.{self.config_class}",
                             config_from_json=self.config_from_json,
                             to_hf=self.to_hf, hf_config=self.hf_config)


def _family_modules() -> dict:
    """The modules of FAMILIES by name; imported here, statically, so the layering test sees them."""
    from shardzoo.models import bert, gpt2, opt, vit

    return {m.__name__: m for m in (bert, gpt2, opt, vit)}


FAMILIES: dict[str, Family] = {
    "gpt2": Family("gpt2", "gpt2", "GPT2LMHeadModel", "transformer.", ("lm_head.",), "shardzoo.models.gpt2",
                   "GPT2", "GPT2Config"),
    "bert": Family("bert", "bert", "BertForMaskedLM", "bert.", ("cls.",), "shardzoo.models.bert", "BERT",
                   "BERTConfig", optional_prefixes=("bert.pooler.",)),
    "vit": Family("vit", "vit", "ViTForImageClassification", "vit.", ("classifier.",), "shardzoo.models.vit", "ViT",
                  "ViTConfig"),
    "opt": Family("opt", "opt", "OPTForCausalLM", "model.", ("lm_head.",), "shardzoo.models.opt", "OPT",
                  "OPTConfig"),
}


for _family in FAMILIES.values():  # checkpoint export finds the families through its registry
    register_export_adapter(_family.export_adapter())


def family_named(name: str) -> Family:
    """The family called ``name`` (also accepts a Hugging Face ``model_type``)."""
    key = name.lower().replace("-", "")
    if key not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; choose one of {sorted(FAMILIES)}")
    return FAMILIES[key]


def family_of(obj) -> Family:
    """The family of a model instance or class, or a config instance or class."""
    cls = obj if isinstance(obj, type) else type(obj)
    for fam in FAMILIES.values():
        if cls.__module__ == fam.module and cls.__name__ in (fam.model_class, fam.config_class):
            return fam
    raise ValueError(f"{cls.__name__} is not one of shardzoo's model families ({sorted(FAMILIES)}); Hugging Face "
                     f"loading and export know only those")


def family_of_config_class(path: str | None) -> Family | None:
    """The family whose config class is ``path`` ("shardzoo.models.gpt2.GPT2Config"), else None."""
    for fam in FAMILIES.values():
        if path == f"{fam.module}.{fam.config_class}":
            return fam
    return None
