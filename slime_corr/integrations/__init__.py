"""Adapters that let other RL frameworks call slime_corr with their own signatures, flags and metric names.

- `slime_corr.integrations.slime`: slime's `--custom-tis-function-path` hook, its `--custom-config-path` YAML
  semantics and its metric names (see docs/integrations.md).
"""
