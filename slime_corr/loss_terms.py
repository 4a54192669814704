"""The loss terms GRPO users add to the policy loss: KL to a frozen reference policy, and an entropy bonus.

    add_loss_terms_args(parser)          # slime_corr.flags.loss_terms: slime's flags; a Megatron `extra_args_provider`
    terms = LossTermsConfig.from_args(parser.parse_args())

Per valid token, with lp = log π_θ, lp_ref = log π_ref and H the entropy of π_θ (the math: `slime_corr.losses`):

    l = l_policy + kl_loss_coef · KL_type(lp, lp_ref) − entropy_coef · H

aggregated with the policy loss's own `--loss-agg-mode` and denominator. Flags are slime's: `--use-kl-loss`,
`--kl-loss-coef`, `--kl-loss-type` (k1, k2, k3, low_var_kl), `--entropy-coef`. `--kl-coef` has slime's meaning, a
KL penalty on the reward applied before the advantages, which slime_corr's trainer does not implement: a non-zero
value is refused at parse time (0, slime's default, is accepted). On slime's parser the flags slime defines are
reused (`slime_corr.flags.compose`); the flags' help is on the fields, `slime_corr.flags.loss_terms` adds them.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any

from slime_corr.errors import ConfigError
from slime_corr.fields import flag

KL_LOSS_TYPES = ("k1", "k2", "k3", "low_var_kl")


@dataclass(frozen=True)
class LossTermsConfig:
    """KL and entropy terms of the loss. Field names are the flag names with `-` replaced by `_`.

    use_kl_loss: compute KL(π_θ ‖ π_ref) against a frozen reference policy (reference log-probs come from the
    forward-only pass that computes lp_old); implied by a non-zero kl_loss_coef, and with coefficient 0 it is only
    logged (`kl_loss`). use_unbiased_kl: each token's KL is weighted by ρ = exp(lp − lp_old), the gradient flowing
    through ρ too, so the term is KL(π_θ ‖ π_ref) estimated on π_old's samples (slime's `--use-unbiased-kl`).
    entropy_coef: the entropy bonus (loss −= coef · H).
    """

    use_kl_loss: bool = flag(False, help="KL to a frozen reference policy (the initial model); logged as kl_loss, "
                             "added to the loss with --kl-loss-coef.")
    kl_loss_coef: float = flag(0.0, help="Coefficient of the KL loss (> 0 implies --use-kl-loss).")
    kl_loss_type: str = flag("k1", choices=KL_LOSS_TYPES, help="KL estimator per token, x = lp - lp_ref: k1 = x, "
                             "k2 = x^2/2, k3 = exp(-x) - 1 + x, low_var_kl = k3 clamped to [-10, 10].")
    use_unbiased_kl: bool = flag(False, help="Weight each token's KL by exp(lp - lp_old) (DeepSeek-V3.2's unbiased "
                                 "estimate on pi_old's samples; the gradient flows through the weight too).")
    entropy_coef: float = flag(0.0, help="Entropy bonus: loss -= coef * entropy of the policy (token level).")

    def __post_init__(self) -> None:
        if self.kl_loss_type not in KL_LOSS_TYPES:
            raise ConfigError(f"--kl-loss-type {self.kl_loss_type!r} is not one of {', '.join(KL_LOSS_TYPES)}.")
        if not (math.isfinite(self.kl_loss_coef) and self.kl_loss_coef >= 0):
            raise ConfigError(f"--kl-loss-coef {self.kl_loss_coef} must be a finite number >= 0 (e.g. 0.001).")
        if self.use_unbiased_kl and not self.uses_reference:
            raise ConfigError("--use-unbiased-kl weights the KL loss's tokens, and there is no KL loss: add "
                              "--use-kl-loss and --kl-loss-coef (e.g. 0.001), or drop --use-unbiased-kl.")
        if not math.isfinite(self.entropy_coef):
            raise ConfigError(f"--entropy-coef {self.entropy_coef} must be a finite number (e.g. 0.001).")

    @property
    def uses_reference(self) -> bool:
        """Whether reference log-probs are needed (a reference policy is built and run)."""
        return self.use_kl_loss or self.kl_loss_coef != 0.0

    @property
    def uses_entropy(self) -> bool:
        return self.entropy_coef != 0.0

    @property
    def active(self) -> bool:
        return self.uses_reference or self.uses_entropy

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LossTermsConfig:
        values: dict[str, Any] = {k: getattr(args, k) for k in cls.__dataclass_fields__ if hasattr(args, k)}
        kl_coef = getattr(args, "kl_coef", None) or 0.0
        if kl_coef and values.get("kl_loss_coef"):
            raise ConfigError(f"--kl-coef {kl_coef} and --kl-loss-coef {values['kl_loss_coef']}: only one of them can "
                              "be set (as in slime).")
        if kl_coef:
            raise ConfigError(f"--kl-coef {kl_coef} is slime's KL penalty on the reward (applied before the "
                              "advantages), which slime_corr's trainer does not implement. For a KL term in the loss "
                              f"use --use-kl-loss --kl-loss-coef {kl_coef}.")
        return cls(**values)


__all__ = ["KL_LOSS_TYPES", "LossTermsConfig"]
