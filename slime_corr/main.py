"""The main job: `python -m slime_corr.main [flags]` (or under `torchrun`).

It parses a launch command line (the rollout-correction flags plus the run's own), builds and validates the
configuration, and prints it. `--self-check` stops there.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from slime_corr.arguments import add_rollout_correction_args, parse_rollout_correction_config


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slime_corr.main", description=__doc__, allow_abbrev=False)
    run = parser.add_argument_group(title="run")
    run.add_argument("--self-check", action="store_true", help="Parse flags, build the config, print it, exit.")
    return add_rollout_correction_args(parser)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, config = parse_rollout_correction_config(parser, argv)
    print("rollout correction config:")
    print(config.describe())
    if args.self_check:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
