"""The fork server's imports (tests/job_runner.py): `slime_corr.main` with no cyclic garbage collection while it is
imported, then `slime_corr.startup_gc.freeze_imports()` (one collection, what is left frozen), as
`python -m slime_corr.main` does in a fresh interpreter and tests/conftest.py in each test process once its modules
are collected; the processes forked from the server keep that state.

A full collection then walks only the objects made afterwards. slime_corr/mcore/parallel_groups.py collects at
every teardown (a run's end, a layout change): over the ~450k objects that torch, Megatron and the project leave
after their imports one took ~0.6 s of CPU, and in a process forked from the server it also wrote to every page of
the heap it shares with the server (copy-on-write).
"""

import gc

from slime_corr.startup_gc import freeze_imports

gc.disable()

import slime_corr.main  # noqa: E402, F401 - imported with collection off (module doc)

freeze_imports()
