"""Model and hardware presets of ``shardzoo plan``, each with its source (docs/planner.md).

Model presets are the config.json values of the named checkpoints: those of shardzoo's families
come from the family specs (``FamilySpec.presets``, in each model file), the transformers ones
are below; hardware presets are datasheet figures, with the assumptions stated where a
datasheet gives none (latency, runtime memory, achievable fraction of peak).
"""

from __future__ import annotations

import os

from shardzoo.planner.hardware import GIB, Hardware
from shardzoo.planner.walked import ModelShape

# transformers models, priced by walking their modules and default plan (walk.py): name ->
# (model_type, config fields, source). Built as transformers' config class on the meta device.
_LLAMA31_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=8192)
_LLAMA31 = dict(num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                rope_scaling=_LLAMA31_ROPE, rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu")
HF_MODELS: dict[str, tuple[str, dict, str]] = {
    "llama3-8b": ("llama", dict(_LLAMA31, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                num_attention_heads=32), "meta-llama/Llama-3.1-8B config.json"),
    "llama3-70b": ("llama", dict(_LLAMA31, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                 num_attention_heads=64), "meta-llama/Llama-3.1-70B config.json"),
    "llama3-405b": ("llama", dict(_LLAMA31, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                                  num_attention_heads=128), "meta-llama/Llama-3.1-405B config.json"),
    "qwen2.5-7b": ("qwen2", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                 num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                 max_position_embeddings=131072, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                 sliding_window=131072, use_sliding_window=False, max_window_layers=28,
                                 tie_word_embeddings=False, hidden_act="silu"),
                   "Qwen/Qwen2.5-7B config.json (q, k, v projections with biases, as Qwen2 builds them)"),
    # mixtures of experts: their experts split over ep (docs/planner.md, "Expert parallelism")
    "mixtral-8x7b": ("mixtral", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                     num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                                     num_experts_per_tok=2, vocab_size=32000, max_position_embeddings=32768,
                                     rope_theta=1000000.0, rms_norm_eps=1e-5, sliding_window=None,
                                     tie_word_embeddings=False, hidden_act="silu"),
                     "mistralai/Mixtral-8x7B-v0.1 config.json"),
    "qwen3-30b-a3b": ("qwen3_moe", dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                                        head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                                        decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936,
                                        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                        use_sliding_window=False, sliding_window=None, tie_word_embeddings=False,
                                        hidden_act="silu"),
                      "Qwen/Qwen3-30B-A3B config.json"),
}

# the one achievable fraction of the dense bf16 peak a transformer's matmuls reach, the same on
# every preset (docs/planner.md, "The accelerator model"): checked against the published runs of
# bench/published/narayanan2021.json, never set per run
MATMUL_EFFICIENCY = 0.7
_GPU_ASSUMPTIONS = ("latency 5 us per message inside a node and 10 us across nodes, 1 GiB per device for the CUDA "
                    "context, NCCL and allocator slack, 70% of peak FLOP/s in matmuls (cuBLAS on large bf16 "
                    "shapes; end to end Megatron-LM reaches 44-52% on A100 with everything else included, "
                    "Narayanan et al. 2021), 35% in the flash attention kernel, and elementwise "
                    "kernels at the HBM bandwidth are assumptions")

HARDWARE: dict[str, Hardware] = {
    "a100": Hardware("a100", flops=312e12, memory_bytes=80 * GIB, mem_bandwidth=2.039e12, intra_bandwidth=300e9,
                     inter_bandwidth=25e9, intra_latency=5e-6, inter_latency=10e-6, devices_per_node=8,
                     runtime_bytes=1 * GIB, attention_flops=0.35 * 312e12, elementwise_bandwidth=2.039e12,
                     flops_efficiency=MATMUL_EFFICIENCY, source="NVIDIA A100 datasheet (SXM4 80GB: 312 TFLOP/s bf16 dense, 2039 GB/s HBM2e, NVLink 600 "
                            "GB/s both ways); DGX A100 datasheet (8 GPUs, 8x 200 Gb/s HDR InfiniBand); "
                            + _GPU_ASSUMPTIONS),
    "h100": Hardware("h100", flops=989e12, memory_bytes=80 * GIB, mem_bandwidth=3.35e12, intra_bandwidth=450e9,
                     inter_bandwidth=50e9, intra_latency=5e-6, inter_latency=10e-6, devices_per_node=8,
                     runtime_bytes=1 * GIB, attention_flops=0.35 * 989e12, elementwise_bandwidth=3.35e12,
                     flops_efficiency=MATMUL_EFFICIENCY, source="NVIDIA H100 datasheet (SXM5 80GB: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3, NVLink 900 "
                            "GB/s both ways); DGX H100 datasheet (8 GPUs, 8x 400 Gb/s ConnectX-7); " + _GPU_ASSUMPTIONS),
    "h200": Hardware("h200", flops=989e12, memory_bytes=141 * 10**9, mem_bandwidth=4.8e12, intra_bandwidth=450e9,
                     inter_bandwidth=50e9, intra_latency=5e-6, inter_latency=10e-6, devices_per_node=8,
                     runtime_bytes=1 * GIB, attention_flops=0.35 * 989e12, elementwise_bandwidth=4.8e12,
                     flops_efficiency=MATMUL_EFFICIENCY, source="NVIDIA H200 datasheet (SXM 141 GB HBM3e, 4.8 TB/s, 989 TFLOP/s bf16 dense, NVLink 900 "
                            "GB/s both ways); DGX H200 datasheet (8 GPUs, 8x 400 Gb/s ConnectX-7); " + _GPU_ASSUMPTIONS),
}
CALIBRATED = ("cpu", "calibrate")  # this host, measured (calibration.calibrate) and cached


def family_presets() -> dict[str, tuple[object, dict, str]]:
    """{preset name: (family spec, config fields, source)} of the registered families."""
    import shardzoo.models  # noqa: F401  (registers the families)
    from shardzoo.models.spec import all_specs

    return {name: (spec, fields, source) for spec in all_specs() for name, (fields, source) in spec.presets.items()}


def model_names() -> list[str]:
    return sorted(family_presets()) + sorted(HF_MODELS)


def _transformers(what: str):
    try:
        import transformers
    except ImportError:
        raise ValueError(f"{what} is a transformers model, and transformers is not installed; pip install "
                         f"transformers (or shardzoo[test])") from None
    return transformers


def _walked(config, name: str) -> ModelShape:
    """A transformers config -> its causal LM built on the meta device, walked with its plan."""
    import torch

    from shardzoo.planner.walked import walked_model

    tf = _transformers(name)
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config)
    return walked_model(model, None, name)


def load_model(model) -> ModelShape:
    """A preset name, a Hugging Face model directory (its config.json: shardzoo's families by
    ``model_type``, any other causal LM transformers knows built on the meta device), a
    ModelShape, or an ``nn.Module`` (with its default plan) -> ModelShape, walked from the
    model's modules and plan."""
    if isinstance(model, ModelShape):
        return model
    from torch import nn

    if isinstance(model, nn.Module):
        from shardzoo.planner.walked import walked_model

        return walked_model(model)
    from shardzoo.models.spec import all_specs
    from shardzoo.planner.walked import family_shape

    families = family_presets()
    if model in families:
        spec, fields, _ = families[model]
        return family_shape(spec, spec.config(**fields), model)
    if model in HF_MODELS:
        model_type, fields, _ = HF_MODELS[model]
        return _walked(_transformers(model).AutoConfig.for_model(model_type, **fields), model)
    if os.path.isdir(model) or os.path.isfile(model):
        from shardzoo.models.config import read_json

        data, _ = read_json(model)
        model_type = data.get("model_type") if isinstance(data, dict) else None
        name = os.path.basename(os.path.normpath(model))
        fams = [f for f in all_specs() if f.model_type == model_type]
        if fams:
            return family_shape(fams[0], fams[0].config.from_json(data), name)
        return _from_directory(model, model_type, name)
    raise ValueError(f"unknown model {model!r}: not a preset ({', '.join(model_names())}) and not a directory holding "
                     f"a config.json; pass a preset name or a Hugging Face model directory")


def _from_directory(path: str, model_type, name: str) -> ModelShape:
    """A causal LM of a model_type transformers knows, walked with its default plan."""
    from shardzoo.models.spec import all_specs

    ours = sorted(f.model_type for f in all_specs())
    tf = _transformers(f"{path} (model_type={model_type!r})")
    directory = path if os.path.isdir(path) else os.path.dirname(path) or "."
    try:
        config = tf.AutoConfig.from_pretrained(directory)
    except (ValueError, KeyError, OSError) as err:
        raise ValueError(f"{path}: config.json has model_type={model_type!r}, which is neither one of shardzoo's "
                         f"families {ours} nor a model type transformers knows ({err}); point to a checkpoint of "
                         f"one of them") from None
    try:
        return _walked(config, name)
    except ValueError as err:
        if "AutoModelForCausalLM" in str(err) or "Unrecognized configuration" in str(err):
            raise ValueError(f"{path}: model_type={model_type!r} has no causal-LM class in transformers; the planner "
                             f"prices causal LMs ({err})") from None
        raise
