"""`python -m slime_corr.trainer.torchrun ARGS`: torchrun (`torch.distributed.run`, the same ARGS) whose Ctrl-C ends
as the job's does. A terminal's Ctrl-C reaches the launcher and its workers: each worker ends its run and rank 0
prints where it stopped (`slime_corr.main`); torchrun itself would then raise its `SignalException` (or, when the
workers ended first, a `ChildFailedError` report) as a traceback and exit 1. Here it exits 128 + the signal (130 for
Ctrl-C) with nothing more to say. Any other failure is torchrun's own, unchanged. `scripts/launch_torchrun.sh` uses
it."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence

os.environ.setdefault("LOGLEVEL", "ERROR")  # torchrun's "Received 2 death signal, shutting down workers" warnings

from torch.distributed.elastic.multiprocessing.api import SignalException  # noqa: E402 - after LOGLEVEL
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: E402
from torch.distributed.run import main as torchrun_main  # noqa: E402

INTERRUPTED = 128 + signal.SIGINT  # a worker's exit code after Ctrl-C (slime_corr.main)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        torchrun_main(list(argv) if argv is not None else None)
    except SignalException as e:
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        if all(f.exitcode == INTERRUPTED for f in e.failures.values()):
            return INTERRUPTED
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
