"""YAML as a source of `RolloutCorrectionConfig` fields (`--custom-config-path`, `arguments/*.yaml`): reading a
file into typed field values, and slime's meaning of its YAML keys. `slime_corr.config` merges the sources."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slime_corr.errors import ConfigError


def read_yaml(path: str | Path, field_kinds: Mapping[str, str]) -> dict[str, Any]:
    """The mapping in the YAML file `path`, keys with '_' for '-', each value read as its field's kind in
    `field_kinds` ("float", "bool", "str"; a trailing "?" allows None)."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--custom-config-path {path}: no such file; pass an existing YAML file.")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"--custom-config-path {path}: not valid YAML ({e}).") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"--custom-config-path {path}: expected a mapping of option names to values, got "
            f"{type(data).__name__}."
        )
    return {key: _yaml_value(key, value, path, field_kinds) for key, value in
            ((str(k).replace("-", "_"), v) for k, v in data.items())}


def _yaml_value(key: str, value: Any, path: str | Path, field_kinds: Mapping[str, str]) -> Any:
    """A YAML value as its field's type, or an error that names the file. Numbers written as strings are read as
    numbers (YAML 1.1, which PyYAML follows, reads `1e-4` as a string); a string is never a boolean (`use_tis:
    "no"` would otherwise be true)."""
    kind = field_kinds.get(key)
    if kind is None or (value is None and kind.endswith("?")):
        return value  # an unknown key is reported with the others
    kind = kind.rstrip("?")
    got = f"{value!r} ({type(value).__name__})"
    if kind == "float":
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        elif isinstance(value, numbers.Real) and not isinstance(value, bool):
            return value
        message = "must be a number"
    elif kind == "bool":
        if isinstance(value, bool):
            return value
        message = "must be true or false (unquoted)"
    else:
        if isinstance(value, str):
            return value
        message = "must be a string"
    raise ConfigError(f"--custom-config-path {path}: {key} {message}, got {got}.")


def slime_yaml_meaning(merged: dict[str, Any], yaml_values: Mapping[str, Any], overrides: Mapping[str, Any],
                       path: str, default_tis_upper_bound: float) -> None:
    """slime's meaning of its YAML keys (its `mis.yaml`): `rs_lower_bound: null` / `rs_upper_bound: null` with
    `use_rs` reuse the IS bounds (`tis_lower_bound` as given, else 1/U; U); a `tis_lower_bound` that
    `tis_mode: truncate` ignores is dropped with a notice. A flag given on the command line keeps its meaning."""
    import warnings

    upper = merged.get("tis_upper_bound") or default_tis_upper_bound
    lower = merged.get("tis_lower_bound") or 1.0 / upper
    if merged.get("use_rs"):
        for key, bound in (("rs_upper_bound", upper), ("rs_lower_bound", lower)):
            if key in yaml_values and yaml_values[key] is None and merged.get(key) is None:
                merged[key] = bound
    if (merged.get("tis_mode", "truncate") == "truncate" and yaml_values.get("tis_lower_bound") is not None
            and "tis_lower_bound" not in overrides):
        warnings.warn(f"--custom-config-path {path}: tis_lower_bound {merged.pop('tis_lower_bound')} is ignored by "
                      "tis_mode truncate (as in slime).", stacklevel=4)


__all__ = ["read_yaml", "slime_yaml_meaning"]
