"""Stop the server when the trainer that launched it is gone (imported by this folder's sitecustomize.py).

The launcher starts each server in its own process group (so one PID stops it all) and stops it on every exit path
it sees; a trainer killed with SIGKILL (the OOM killer, a harness's timeout) sees none, and its ~3 GB server would
live on. With ``SLIME_CORR_SERVER_PARENT`` = the launcher's PID in the environment, the group leader (the server's
main process) checks once a second that its parent is still that PID; when it is not, it SIGTERMs its process group
(sglang's own shutdown), and SIGKILLs it 10 s later if anything is left.
"""

import os
import signal
import threading
import time

ENV = "SLIME_CORR_SERVER_PARENT"
POLL_S, GRACE_S = 1.0, 10.0


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    group = os.getpgrp()
    os.killpg(group, signal.SIGTERM)
    time.sleep(GRACE_S)
    os.killpg(group, signal.SIGKILL)


def start() -> None:
    parent = os.environ.get(ENV, "")
    # only the process the launcher started (the leader of its own group): its children share the group
    if parent.isdigit() and os.getpgrp() == os.getpid():
        threading.Thread(target=_watch, args=(int(parent),), name="slime-corr-parent-watch", daemon=True).start()
