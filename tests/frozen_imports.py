"""The fork server's imports (tests/job_runner.py): `slime_corr.main` with no cyclic garbage collection while it is
imported, then one collection and what is left moved to gc's permanent generation (`gc.freeze()`), as
`python -m slime_corr.main` does in a fresh interpreter and tests/conftest.py in each test process once its modules
are collected; the processes forked from the server keep that state.

A full collection then walks only the objects made afterwards. slime_corr/mcore/parallel_groups.py collects at
every teardown (a run's end, a layout change): over the ~450k objects that torch, Megatron and the project leave
after their imports one took ~0.6 s of CPU, and in a process forked from the server it also wrote to every page of
the heap it shares with the server (copy-on-write).
"""

import gc

gc.disable()

import slime_corr.main  # noqa: E402, F401 - imported with collection off (module doc)

gc.collect()
gc.freeze()
gc.enable()
