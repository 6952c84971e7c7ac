"""``shardzoo convert CKPT OUT``: export a sharded checkpoint as plain (Hugging Face layout) safetensors."""

from __future__ import annotations

import argparse
import re

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


def parse_size(text: str) -> int:
    """"5GB" -> 5_000_000_000, "512MiB" -> 536_870_912, "1000" -> 1000."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"cannot read size {text!r}; write e.g. 5GB, 500MB, 2GiB or a number of bytes")
    return int(float(match.group(1)) * _UNITS[unit])


def _convert(args: argparse.Namespace) -> int:
    from shardzoo.checkpoint import CheckpointError, export_plain, read_index
    from shardzoo.checkpoint.exporting import has_hf_names

    try:
        index = read_index(args.ckpt) if args.names == "hf" else None
        if index is not None and not has_hf_names(index) and not _transformers_class(index):
            print(f"shardzoo convert: {args.ckpt} was saved without the config of a shardzoo model family (GPT-2, BERT, "
                  f"ViT, OPT) or of a transformers model, so its tensors have no Hugging Face names and there is no config.json that transformers "
                  f"could load; nothing was written. Save the model with checkpoint.save(model, dir) from a shardzoo "
                  f"family model (it records model.config) or pass config=<the family's config>, then convert again; "
                  f"or export the saved names and config as they are with --names shardzoo (not a Hugging Face model "
                  f"directory)")
            return 1
        written = export_plain(args.ckpt, args.out, max_shard_bytes=args.max_shard_size, names=args.names,
                               progress=not args.no_progress)
    except CheckpointError as e:
        print(f"shardzoo convert: {e}")
        return 1
    print(f"wrote {len(written)} file(s) to {args.out}")
    return 0


def _transformers_class(index: dict) -> str | None:
    """The config class name of a checkpoint saved from a transformers model ("GPT2Config"), else
    None. Its saved names are already that model's Hugging Face names and its config is
    transformers' own, so ``--names hf`` exports them unchanged."""
    path = index.get("config_class") or ""
    return path.rsplit(".", 1)[-1] if path.startswith("transformers.") else None


def add_convert_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``convert`` subcommand to ``subparsers`` (from ``parser.add_subparsers()``)."""
    from shardzoo.checkpoint.exporting import DEFAULT_MAX_SHARD_BYTES

    parser = subparsers.add_parser(
        "convert", help="export a sharded checkpoint as plain safetensors (Hugging Face layout)",
        description="Assemble every tensor of a shardzoo checkpoint (any layout) and write model.safetensors "
                    "(or model-0000i-of-0000N.safetensors + model.safetensors.index.json) and config.json. A checkpoint "
                    "of a shardzoo model family (GPT-2, BERT, ViT, OPT) gets Hugging Face names and config.json; one "
                    "of a transformers model (shardzoo.parallelize) keeps its names and config, which already are "
                    "transformers'. Either way transformers' from_pretrained(OUT) loads it.")
    parser.add_argument("ckpt", metavar="CKPT", help="checkpoint directory written by shardzoo.checkpoint.save")
    parser.add_argument("out", metavar="OUT", help="output directory (created)")
    parser.add_argument("--max-shard-size", type=parse_size, default=DEFAULT_MAX_SHARD_BYTES,
                        help="largest output file before splitting, e.g. 5GB (default), 500MB, 2GiB")
    parser.add_argument("--names", choices=("hf", "shardzoo"), default="hf",
                        help="hf (default): Hugging Face names, layouts and config.json; only for checkpoints of "
                             "shardzoo's model families and of transformers models (others exit with status 1 and "
                             "write nothing); shardzoo: the "
                             "saved names and config unchanged, for any checkpoint (not a Hugging Face directory)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=_convert)
    return parser
