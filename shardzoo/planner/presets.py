"""Model and hardware presets of ``shardzoo plan``, each with its source (docs/planner.md).

Model presets are the config.json values of the named checkpoints (the configs shardzoo's model
families read); hardware presets are datasheet figures, with the assumptions stated where a
datasheet gives none (latency, runtime memory, achievable fraction of peak).
"""

from __future__ import annotations

import os

from shardzoo.planner.hardware import GIB, Hardware
from shardzoo.planner.model import ModelShape

# name -> (family, config fields, source)
MODELS: dict[str, tuple[str, dict, str]] = {
    "gpt2": ("gpt2", dict(n_layer=12, n_embd=768, n_head=12), "openai-community/gpt2 config.json"),
    "gpt2-medium": ("gpt2", dict(n_layer=24, n_embd=1024, n_head=16), "openai-community/gpt2-medium config.json"),
    "gpt2-xl": ("gpt2", dict(n_layer=48, n_embd=1600, n_head=25), "openai-community/gpt2-xl config.json"),
    "gpt3-175b": ("gpt2", dict(n_layer=96, n_embd=12288, n_head=96, n_positions=2048),
                  "Brown et al. 2020, Table 2.1 (GPT-3 175B: 96 layers, d_model 12288, 96 heads, context 2048; "
                  "GPT-2 vocabulary)"),
    "bert-base": ("bert", dict(), "google-bert/bert-base-uncased config.json"),
    "bert-large": ("bert", dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                intermediate_size=4096), "google-bert/bert-large-uncased config.json"),
    "opt-1.3b": ("opt", dict(hidden_size=2048, num_hidden_layers=24, ffn_dim=8192, num_attention_heads=32),
                 "facebook/opt-1.3b config.json"),
    "opt-13b": ("opt", dict(hidden_size=5120, num_hidden_layers=40, ffn_dim=20480, num_attention_heads=40),
                "facebook/opt-13b config.json"),
    "opt-175b": ("opt", dict(hidden_size=12288, num_hidden_layers=96, ffn_dim=49152, num_attention_heads=96),
                 "Zhang et al. 2022 (OPT), Table 1: 96 layers, 96 heads, hidden 12288"),
    "vit-base": ("vit", dict(num_labels=1000), "google/vit-base-patch16-224 config.json"),
    "vit-huge": ("vit", dict(hidden_size=1280, num_hidden_layers=32, num_attention_heads=16, intermediate_size=5120,
                             patch_size=14, num_labels=21843), "google/vit-huge-patch14-224-in21k config.json"),
}

_GPU_ASSUMPTIONS = ("latency 5 us per message inside a node and 10 us across nodes, 1 GiB per device for the CUDA "
                    "context, NCCL and allocator slack, 50% of peak FLOP/s in matmuls (Megatron-LM reports 44-52% "
                    "on A100 for GPT models, Narayanan et al. 2021), 35% in the attention kernel, and elementwise "
                    "kernels at the HBM bandwidth are assumptions")

HARDWARE: dict[str, Hardware] = {
    "a100": Hardware("a100", flops=312e12, memory_bytes=80 * GIB, mem_bandwidth=2.039e12, intra_bandwidth=300e9,
                     inter_bandwidth=25e9, intra_latency=5e-6, inter_latency=10e-6, devices_per_node=8,
                     runtime_bytes=1 * GIB, attention_flops=0.35 * 312e12, elementwise_bandwidth=2.039e12,
                     flops_efficiency=0.5, source="NVIDIA A100 datasheet (SXM4 80GB: 312 TFLOP/s bf16 dense, 2039 GB/s HBM2e, NVLink 600 "
                            "GB/s both ways); DGX A100 datasheet (8 GPUs, 8x 200 Gb/s HDR InfiniBand); "
                            + _GPU_ASSUMPTIONS),
    "h100": Hardware("h100", flops=989e12, memory_bytes=80 * GIB, mem_bandwidth=3.35e12, intra_bandwidth=450e9,
                     inter_bandwidth=50e9, intra_latency=5e-6, inter_latency=10e-6, devices_per_node=8,
                     runtime_bytes=1 * GIB, attention_flops=0.35 * 989e12, elementwise_bandwidth=3.35e12,
                     flops_efficiency=0.5, source="NVIDIA H100 datasheet (SXM5 80GB: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3, NVLink 900 "
                            "GB/s both ways); DGX H100 datasheet (8 GPUs, 8x 400 Gb/s ConnectX-7); " + _GPU_ASSUMPTIONS),
    "h200": Hardware("h200", flops=989e12, memory_bytes=141 * 10**9, mem_bandwidth=4.8e12, intra_bandwidth=450e9,
                     inter_bandwidth=50e9, intra_latency=5e-6, inter_latency=10e-6, devices_per_node=8,
                     runtime_bytes=1 * GIB, attention_flops=0.35 * 989e12, elementwise_bandwidth=4.8e12,
                     flops_efficiency=0.5, source="NVIDIA H200 datasheet (SXM 141 GB HBM3e, 4.8 TB/s, 989 TFLOP/s bf16 dense, NVLink 900 "
                            "GB/s both ways); DGX H200 datasheet (8 GPUs, 8x 400 Gb/s ConnectX-7); " + _GPU_ASSUMPTIONS),
}
CALIBRATED = ("cpu", "calibrate")  # this host, measured (calibration.calibrate) and cached


def model_names() -> list[str]:
    return sorted(MODELS)


def load_model(model: str | ModelShape) -> ModelShape:
    """A preset name or a Hugging Face model directory (its config.json; the family from its
    ``model_type``, as ``from_pretrained``) -> ModelShape."""
    if isinstance(model, ModelShape):
        return model
    from shardzoo.models.spec import all_specs, spec_named

    if model in MODELS:
        family, fields, _ = MODELS[model]
        return ModelShape(family, spec_named(family).config(**fields), model)
    if os.path.isdir(model) or os.path.isfile(model):
        from shardzoo.models.config import read_json

        data, _ = read_json(model)
        model_type = data.get("model_type") if isinstance(data, dict) else None
        fams = [f for f in all_specs() if f.model_type == model_type]
        if not fams:
            raise ValueError(f"{model}: config.json has model_type={model_type!r}; shardzoo plans the families "
                             f"{sorted(f.model_type for f in all_specs())}. Point to a checkpoint of one of them")
        return ModelShape(fams[0].name, fams[0].config.from_json(data), os.path.basename(os.path.normpath(model)))
    raise ValueError(f"unknown model {model!r}: not a preset ({', '.join(model_names())}) and not a directory holding "
                     f"a config.json; pass a preset name or a Hugging Face model directory")
