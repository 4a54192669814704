"""Drop-in for slime users: slime's `--custom-tis-function-path` hook, its YAML semantics, its metric names.

    --custom-tis-function-path slime_corr.integrations.slime.compute_mis_weights_with_cp   # full correction
    --custom-tis-function-path slime_corr.integrations.slime.vanilla_tis_function          # slime's default TIS
    --custom-tis-function-path slime_corr.integrations.slime.icepop_function               # slime's IcePop

`hook.py` (the functions), `config.py` (slime's settings -> `RolloutCorrectionConfig`), `layout.py` (slime's CP
layout), `names.py` (slime's metric names). The hook functions are imported on first use (torch and the
correction core), so the names table stays cheap to import for the logger.
"""

from typing import Any

from slime_corr.integrations.slime.config import config_from_slime_args
from slime_corr.integrations.slime.names import LOGGED_NAMES, METRIC_NAMINGS, MIS_NAMES, slime_named

_HOOKS = ("compute_mis_weights_with_cp", "icepop_function", "tis_function", "vanilla_tis_function")


def __getattr__(name: str) -> Any:
    if name in _HOOKS:
        from slime_corr.integrations.slime import hook  # lazily: see the module doc

        return getattr(hook, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "LOGGED_NAMES",
    "METRIC_NAMINGS",
    "MIS_NAMES",
    "compute_mis_weights_with_cp",
    "config_from_slime_args",
    "icepop_function",
    "slime_named",
    "tis_function",
    "vanilla_tis_function",
]
