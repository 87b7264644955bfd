"""``lp-export``: a checkpoint's Hugging Face model -> a folder ``from_pretrained`` loads.

    lp-export checkpoints/last.ckpt hf_model/                   # a split run's directory or a .ckpt file
    lp-export last.ckpt hf_model/ --merge                       # LoRA folded into the base weights
    lp-export one_device.ckpt hf_model/ --config pretrained/    # a checkpoint another strategy saved

The logic is in ``lightning_parallel/checkpoint/export.py``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

from lightning_parallel.checkpoint.export import export
from lightning_parallel.cli.entry import enter_command


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="lp-export",
        description="Write the Hugging Face model a Lightning checkpoint's module holds in save_pretrained layout.",
    )
    parser.add_argument("checkpoint", type=Path,
                        help="a checkpoint directory written by ParallelStrategy, or a plain .ckpt file")
    parser.add_argument("output", type=Path, help="new (or empty) folder to write")
    parser.add_argument("--module", help="attribute path of the model to export, when the module holds several")
    parser.add_argument("--config", type=Path,
                        help="folder with the model's config.json, for a checkpoint saved by another strategy")
    parser.add_argument("--merge", action="store_true",
                        help="fold the LoRA adapters into the base weights and write a plain model folder")
    parser.add_argument("--max-shard-size", help="largest safetensors file, e.g. 5GB (default: save_pretrained's)")
    args = parser.parse_args(argv)
    enter_command("lp-export")  # the checkpoint may name classes of the folder it runs in
    try:
        message = export(args.checkpoint, args.output, module=args.module, config=args.config, merge=args.merge,
                         max_shard_size=args.max_shard_size)
    except (ValueError, FileNotFoundError) as err:  # ExportError, a bad --config; IncompleteCheckpointError
        parser.exit(2, f"lp-export: {err}\n")
    print(message)


if __name__ == "__main__":
    main()
