"""``lp-consolidate``: turn a sharded checkpoint directory into one plain Lightning checkpoint file.

    lp-consolidate checkpoints/epoch=0-step=100.ckpt model.ckpt

The conversion is ``checkpoint.consolidate``; see there for what the file holds.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="lp-consolidate", description="Turn a sharded checkpoint directory into one plain Lightning checkpoint."
    )
    parser.add_argument("checkpoint", type=Path, help="sharded checkpoint directory written by ParallelStrategy")
    parser.add_argument("output", type=Path, help="plain .ckpt file to write")
    args = parser.parse_args(argv)
    from lightning_parallel.cli.entry import enter_command

    enter_command("lp-consolidate")  # the checkpoint may name classes of the folder it runs in
    import torch

    from lightning_parallel.checkpoint.atomic import IncompleteCheckpointError
    from lightning_parallel.checkpoint.consolidate import consolidate

    try:
        checkpoint = consolidate(args.checkpoint)
    except (IncompleteCheckpointError, ValueError) as err:
        parser.exit(2, f"lp-consolidate: {err}\n")
    torch.save(checkpoint, args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
