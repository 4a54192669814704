"""The `slime-corr` command: `slime-corr report RUN_DIR ...` writes a run's report (plots and a preset
recommendation, `slime_corr.monitoring.report`); any other arguments run the main job (`slime_corr.main`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from slime_corr.monitoring.report import main as report_main

SUBCOMMANDS = ("report",)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "report":
        return report_main(args[1:])
    from slime_corr.main import main as run_main  # lazily: a report needs no Megatron

    return run_main(args)


if __name__ == "__main__":
    sys.exit(main())
