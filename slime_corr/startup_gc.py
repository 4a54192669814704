"""Cyclic garbage collection around a process's start-up imports. torch's, megatron-core's and transformers' imports
make ~730k objects, and the collections they set off walk them again and again (`import slime_corr.main`: 5.8-7.1
CPU-s with collection on, 4.7-4.8 with it off). A process turns collection off before those imports
(`gc.disable()`) and calls `freeze_imports()` once they are done. The standard library only.

(slime_corr/engines/sglang_cpu/sitecustomize.py does the same in the SGLang server, whose interpreter has no
slime_corr to import.)"""

from __future__ import annotations

import gc


def freeze_imports() -> None:
    """One collection, then what is left frozen (`gc.freeze()`: later collections skip it), then collection on again.

    The collection frees the imports' garbage, and it sets the size the collector compares the objects made later
    with before it walks them all again: frozen without it, that size is 0, and every tenth collection of the older
    generation walked every object the run had made (forked ranks of the tests: 2-4 CPU-s more per module)."""
    gc.collect()
    gc.freeze()
    gc.enable()


__all__ = ["freeze_imports"]
