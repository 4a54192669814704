"""Imported last by tests/job_runner.py's fork server (after `slime_corr.main`): what the server imported moves to
gc's permanent generation (`gc.freeze()`), as tests/conftest.py does in each test process once its modules are
collected.

A full collection then walks only the objects made afterwards. slime_corr/mcore/parallel_groups.py collects at
every teardown (a run's end, a layout change): over the ~450k objects that torch, Megatron and the project leave
after their imports one took ~0.6 s of CPU, and in a process forked from the server it also wrote to every page of
the heap it shares with the server (copy-on-write).
"""

import gc

gc.freeze()
