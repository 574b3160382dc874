"""``zerotrain ckpt``: look at, check and export sharded checkpoints, straight from storage.

    zerotrain ckpt list URI                                   committed checkpoints under URI
    zerotrain ckpt verify URI                                 every file against the manifest
    zerotrain ckpt consolidate URI OUT [--dtype fp32|bf16] [--max-shard-mb MB] [--layout zerotrain|gpt2]

``consolidate`` writes OUT as a Hugging Face-style directory (``model-0000k-of-0000N.safetensors``
shards, ``model.safetensors.index.json``, ``config.json``), or one file when OUT ends in
``.safetensors``; either is a valid ``model.init_from`` for a fine-tuning job. A ``model.hf`` job's
output is what transformers loads (``from_pretrained(OUT)``): its names, its config.json and
tokenizer files. ``--layout gpt2`` writes a GPT preset as ``GPT2LMHeadModel`` instead of
zerotrain's own names (which stay the default: that is what ``model.init_from`` reads for a preset).
URI is a checkpoint directory (``.../checkpoints/step_00000100``), a job's ``checkpoints``
directory or its job directory (then: the latest committed checkpoint); ``file://``,
a plain path or ``s3://`` (endpoint from ``ZEROTRAIN_S3_ENDPOINT_URL``, credentials from the
usual ``AWS_*`` variables). No server is involved, and no torch is imported: consolidation
streams tensor by tensor in a few tens of MB whatever the model's size.
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.table import Column

from service.cli.errors import CliError
from service.cli.output import out, output_option, print_items


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``ckpt`` (with ``list``, ``verify``, ``consolidate``) to an argparse ``subparsers``."""
    parser = subparsers.add_parser("ckpt", help="list, verify and consolidate sharded checkpoints",
                                   description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="ckpt_command", required=True, metavar="COMMAND")
    listing = commands.add_parser("list", help="committed checkpoints under URI (a job or its checkpoints dir)")
    listing.add_argument("uri")
    output_option(listing)
    verify = commands.add_parser("verify", help="check every file of a checkpoint against its manifest")
    verify.add_argument("uri")
    consolidate = commands.add_parser("consolidate", help="write ordinary safetensors weights (a directory "
                                                            "as Hugging Face writes it, or one .safetensors file)")
    consolidate.add_argument("uri")
    consolidate.add_argument("out", metavar="OUT", help="a directory (sharded safetensors + index + config.json), "
                                                        "or a file ending in .safetensors")
    consolidate.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                             help="dtype of floating-point tensors (default fp32)")
    consolidate.add_argument("--max-shard-mb", type=_positive_mb, default=None, metavar="MB",
                             help="largest shard of a directory, in MB (default 5000, Hugging Face's); "
                                  "a larger tensor gets a shard of its own")
    consolidate.add_argument("--layout", choices=("zerotrain", "gpt2"), default="zerotrain",
                             help="a GPT preset's names: zerotrain's own (default; what model.init_from reads) or "
                                  "GPT2LMHeadModel's (transformers loads it). A model.hf job always gets its own names")
    for sub in (listing, verify, consolidate):
        sub.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Dispatch ``args.ckpt_command``; user mistakes raise ``CliError`` (one line, exit 2)."""
    from storage.manifest import CheckpointNotFound

    handler = {"list": _list, "verify": _verify, "consolidate": _consolidate}[args.ckpt_command]
    try:
        return handler(args)
    except CheckpointNotFound as missing:
        raise CliError(str(missing)) from None
    except (FileNotFoundError, PermissionError, ValueError) as problem:
        raise CliError(f"{type(problem).__name__}: {problem}") from None


def _list(args: argparse.Namespace) -> int:
    from storage.manifest import committed_steps, read_manifest, step_dir, step_dirs, total_size
    from storage.storage import Storage

    where = Storage.at(args.uri)
    if not step_dirs(where) and step_dirs(where.child("checkpoints")):
        where = where.child("checkpoints")
    steps = committed_steps(where)
    if not steps:
        raise CliError(f"no committed checkpoint under {args.uri}")
    listed = []
    for step in steps:
        checkpoint = where.child(step_dir(step))
        manifest = read_manifest(checkpoint)
        listed.append({"step": step, "uri": checkpoint.uri, "world_size": manifest["world_size"],
                       "stage": manifest["stage"], "precision": manifest["precision"],
                       "size_bytes": total_size(manifest), "created_at": manifest.get("created_at")})
    columns = ("step", "world", "stage", "precision", "size", "created (UTC)", Column("uri", overflow="fold"))
    return print_items(args, listed, columns, lambda item: (
        str(item["step"]), str(item["world_size"]), str(item["stage"]), item["precision"], _mb(item["size_bytes"]),
        (item["created_at"] or "")[:19].replace("T", " "), item["uri"]))


def _verify(args: argparse.Namespace) -> int:
    from storage.manifest import resolve
    from workers.checkpointing.verify import verify

    checkpoint = resolve(args.uri)
    problems = verify(checkpoint)
    for problem in problems:
        out.print(f"[red]BAD[/] {checkpoint.uri}/{problem}", highlight=False, soft_wrap=True)
    if problems:
        return 1
    out.print(f"OK {checkpoint.uri}", highlight=False, soft_wrap=True)
    return 0


def _positive_mb(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of MB, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of MB, got {text!r}")
    return value


def _consolidate(args: argparse.Namespace) -> int:
    from workers.checkpointing.consolidate import consolidate

    shard = {} if args.max_shard_mb is None else {"max_shard_bytes": max(1, int(args.max_shard_mb * 1e6))}
    report = consolidate(args.uri, args.out, dtype=args.dtype, layout=args.layout, **shard)
    files = "" if report.files == 1 else f" in {report.files} files"
    config = "; config.json" if report.config else ""
    out.print(f"wrote {args.out}: {report.tensors} tensors{files}, {_mb(report.bytes_written)} "
              f"(step {report.step}, {args.dtype}; largest tensor {_mb(report.largest_tensor_bytes)}{config})",
              highlight=False, soft_wrap=True)
    return 0


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"
