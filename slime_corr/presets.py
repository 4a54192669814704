"""The named presets of the references (000, "Preset Method" table), as `RolloutCorrectionConfig` field values.
`RolloutCorrectionConfig.preset(name, **overrides)` builds one."""

from __future__ import annotations

from typing import Any

# IS threshold 2.0; sequence RS [0.5, 2.0];
# geometric RS [1/1.001, 1.001] (tight on purpose: the average per-token ratio) with veto 1e-4.
PRESETS: dict[str, dict[str, Any]] = {
    "decoupled_token_is": dict(use_tis=True, tis_level="token", tis_mode="truncate", tis_upper_bound=2.0),
    "decoupled_seq_is": dict(use_tis=True, tis_level="sequence", tis_mode="truncate", tis_upper_bound=2.0),
    "decoupled_seq_is_rs": dict(
        use_tis=True,
        tis_level="sequence",
        tis_mode="truncate",
        tis_upper_bound=2.0,
        use_rs=True,
        rs_level="sequence",
        rs_lower_bound=0.5,
        rs_upper_bound=2.0,
    ),
    "decoupled_geo_rs": dict(use_rs=True, rs_level="geometric", rs_upper_bound=1.001, rs_veto_threshold=1e-4),
    "ppo_is_bypass": dict(use_rollout_logprobs=True, loss_type="ppo", get_mismatch_metrics=True),
    "pg_is": dict(
        use_rollout_logprobs=True,
        loss_type="reinforce",
        use_tis=True,
        tis_level="sequence",
        tis_mode="truncate",
        tis_upper_bound=2.0,
    ),
    "pg_rs": dict(
        use_rollout_logprobs=True,
        loss_type="reinforce",
        use_rs=True,
        rs_level="geometric",
        rs_upper_bound=1.001,
        rs_veto_threshold=1e-4,
    ),
    "disabled": dict(get_mismatch_metrics=True),
    # divergence rejection (verl's k3 presets: seq_mean_k3 at 0.005; its seq_max_k2 spike filter at 2.5)
    "decoupled_k3_rs": dict(rs_metric="k3", rs_agg="mean", rs_divergence_bound=0.005),
    "decoupled_token_is_k3_rs": dict(use_tis=True, tis_level="token", tis_mode="truncate", tis_upper_bound=2.0,
                                     rs_metric="k3", rs_agg="mean", rs_divergence_bound=0.005),
    "decoupled_token_is_max_k2_rs": dict(use_tis=True, tis_level="token", tis_mode="truncate", tis_upper_bound=2.0,
                                         rs_metric="k2", rs_agg="max", rs_divergence_bound=2.5),
    "ppo_k3_rs_bypass": dict(use_rollout_logprobs=True, loss_type="ppo", rs_metric="k3", rs_agg="mean",
                             rs_divergence_bound=0.005),
}

__all__ = ["PRESETS"]
