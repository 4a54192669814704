"""slime's rollout-correction settings, read with slime's meaning, as a `RolloutCorrectionConfig`.

slime puts every key of its `--custom-config-path` YAML on `args` (the YAML wins over flags), so its settings
are attributes of `args`. Read as slime's `mis.py` reads them (`examples/train_infer_mismatch_helper`):

- `--use-tis` switches the correction on; without it only the mismatch metrics are computed (a `use_rs`,
  bound or veto given then is ignored, with a notice, as slime does);
- `tis_mode` truncate / clip / mask, `tis_level` token / sequence / geometric (defaults truncate, token);
  `tis_upper_bound` U (default 2.0); `tis_lower_bound` L (default 1/U): truncate ignores it (notice);
- `use_rs` with `rs_level`, `rs_lower_bound` / `rs_upper_bound`; a null RS bound reuses the IS bound
  (`tis_lower_bound` as given, else 1/U; U);
- `rs_veto_threshold` C: slime's mis.py applies it only together with `use_rs`; slime documents it as independent
  of IS/RS, and slime_corr applies it either way (notice when `use_rs` is off);
- `tis_batch_normalize`.

Without any of those keys on `args` (a plain `--use-tis --tis-clip C --tis-clip-low c` run), the weights are
slime's default `vanilla_tis_function`: the token ratio clamped to [c, C]. `icepop_function`: the token ratio
where it is inside [c, C], else 0.
"""

from __future__ import annotations

import sys
from typing import Any

from slime_corr.config import DEFAULT_TIS_UPPER_BOUND, RolloutCorrectionConfig

MIS_KEYS = ("tis_mode", "tis_level", "tis_lower_bound", "tis_upper_bound", "tis_batch_normalize", "use_rs",
            "rs_level", "rs_lower_bound", "rs_upper_bound", "rs_veto_threshold")
KINDS = ("mis", "vanilla", "icepop")
_DEFAULTS = {"tis_mode": "truncate", "tis_level": "token", "rs_level": "token"}
NO_LOWER_BOUND = sys.float_info.min  # slime's --tis-clip-low 0: no lower bound (ratios are > 0)


def _get(args: Any, name: str, default: Any = None) -> Any:
    value = getattr(args, name, None)
    return default if value is None else value


def uses_mis_keys(args: Any) -> bool:
    """Whether `args` carries mis.py's settings (from the YAML, or slime_corr's flags on slime's parser set to
    something other than their defaults)."""
    return any(getattr(args, k, None) not in (None, False, _DEFAULTS.get(k)) for k in MIS_KEYS)


def effective_kind(args: Any, kind: str) -> str:
    """What hook `kind` computes for `args`: "mis" without mis.py settings is slime's default TIS ("vanilla") with
    --use-tis, else metrics only ("metrics")."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} is not one of {', '.join(KINDS)}")
    if kind == "mis" and not uses_mis_keys(args):
        return "vanilla" if getattr(args, "use_tis", False) else "metrics"
    return kind


def slime_settings(args: Any, kind: str = "mis") -> tuple[dict[str, Any], list[str]]:
    """(`RolloutCorrectionConfig` fields, notices) of slime's `args` for hook `kind` (mis, vanilla, icepop)."""
    kind = effective_kind(args, kind)
    notices: list[str] = []
    values: dict[str, Any] = dict(get_mismatch_metrics=True)
    if getattr(args, "rollout_correction_compile", False):
        values["rollout_correction_compile"] = True
    if kind in ("vanilla", "icepop"):  # slime applies these whenever it calls them
        values["use_rollout_logprobs"] = bool(getattr(args, "use_rollout_logprobs", False))  # refused with IS
        upper = float(_get(args, "tis_clip", DEFAULT_TIS_UPPER_BOUND))
        lower = float(_get(args, "tis_clip_low", 0.0))
        if kind == "vanilla":
            values.update(use_tis=True, tis_clip=upper, tis_clip_low=lower)
        else:
            values.update(use_tis=True, tis_mode="mask", tis_upper_bound=upper,
                          tis_lower_bound=lower if lower > 0 else NO_LOWER_BOUND)
        return values, notices
    if kind == "metrics":
        return values, notices

    given = {k: getattr(args, k) for k in MIS_KEYS
             if getattr(args, k, None) not in (None, False) and getattr(args, k) != _DEFAULTS.get(k)}
    if not getattr(args, "use_tis", False):
        if given:
            notices.append(f"{', '.join(sorted(given))} ignored: without --use-tis slime computes the mismatch "
                           "metrics only.")
        return values, notices
    mode, level = _get(args, "tis_mode", "truncate"), _get(args, "tis_level", "token")
    upper = float(_get(args, "tis_upper_bound", DEFAULT_TIS_UPPER_BOUND))
    lower_given = getattr(args, "tis_lower_bound", None)
    lower = float(lower_given) if lower_given is not None else 1.0 / upper
    values.update(use_tis=True, tis_mode=mode, tis_level=level, tis_upper_bound=upper,
                  use_rollout_logprobs=bool(getattr(args, "use_rollout_logprobs", False)))
    if mode == "truncate":
        if lower_given is not None:
            notices.append(f"tis_lower_bound {lower_given} ignored by tis_mode truncate (slime: 'For truncate mode, "
                           "it will not be used'); it is still the default lower RS bound.")
    else:
        values["tis_lower_bound"] = lower
    if getattr(args, "tis_batch_normalize", False):
        values["tis_batch_normalize"] = True
    if getattr(args, "use_rs", False):
        values.update(use_rs=True, rs_level=_get(args, "rs_level", "token"),
                      rs_upper_bound=float(_get(args, "rs_upper_bound", upper)),
                      rs_lower_bound=float(_get(args, "rs_lower_bound", lower)))
    veto = getattr(args, "rs_veto_threshold", None)
    if veto is not None:
        values["rs_veto_threshold"] = float(veto)
        if not getattr(args, "use_rs", False):
            notices.append(f"rs_veto_threshold {veto} applied without use_rs: slime documents the veto as "
                           "independent of IS/RS (its mis.py applies it only with use_rs).")
    return values, notices


def config_from_slime_args(args: Any, kind: str = "mis") -> tuple[RolloutCorrectionConfig, list[str]]:
    """The validated config of slime's `args` (see the module doc) and the notices about ignored settings."""
    values, notices = slime_settings(args, kind)
    return RolloutCorrectionConfig(**values), notices


__all__ = ["KINDS", "MIS_KEYS", "config_from_slime_args", "effective_kind", "slime_settings", "uses_mis_keys"]
