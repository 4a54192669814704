"""The loss terms GRPO users add to the policy loss: KL to a frozen reference policy, and an entropy bonus.

    add_loss_terms_args(parser)                       # slime's flags; a Megatron `extra_args_provider` too
    terms = LossTermsConfig.from_args(parser.parse_args())

Per valid token, with lp = log π_θ, lp_ref = log π_ref and H the entropy of π_θ (the math: `slime_corr.losses`):

    l = l_policy + kl_loss_coef · KL_type(lp, lp_ref) − entropy_coef · H

aggregated with the policy loss's own `--loss-agg-mode` and denominator. Flags are slime's: `--use-kl-loss`,
`--kl-loss-coef`, `--kl-loss-type` (k1, k2, k3, low_var_kl), `--entropy-coef`. `--kl-coef` is accepted as another
name of `--kl-loss-coef`: in slime it is a different knob (a KL penalty on the reward, which its GRPO advantage does
not use), which slime_corr does not implement.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any

from slime_corr.config import ConfigError

KL_LOSS_TYPES = ("k1", "k2", "k3", "low_var_kl")


@dataclass(frozen=True)
class LossTermsConfig:
    """KL and entropy terms of the loss. Field names are the flag names with `-` replaced by `_`.

    use_kl_loss: compute KL(π_θ ‖ π_ref) against a frozen reference policy (reference log-probs come from the
    forward-only pass that computes lp_old); implied by a non-zero kl_loss_coef, and with coefficient 0 it is only
    logged (`kl_loss`). entropy_coef: the entropy bonus (loss −= coef · H).
    """

    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "k1"
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        if self.kl_loss_type not in KL_LOSS_TYPES:
            raise ConfigError(f"--kl-loss-type {self.kl_loss_type!r} is not one of {', '.join(KL_LOSS_TYPES)}.")
        if not (math.isfinite(self.kl_loss_coef) and self.kl_loss_coef >= 0):
            raise ConfigError(f"--kl-loss-coef {self.kl_loss_coef} must be a finite number >= 0 (e.g. 0.001).")
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
        return cls(**values)


def add_loss_terms_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """slime's KL-loss and entropy flags (see the module doc). Returns the parser."""
    g = parser.add_argument_group(title="KL and entropy loss terms (slime's flags)")
    d = LossTermsConfig()
    g.add_argument("--use-kl-loss", action="store_true", default=d.use_kl_loss,
                   help="KL to a frozen reference policy (the initial model); logged as kl_loss, added to the loss "
                        "with --kl-loss-coef.")
    g.add_argument("--kl-loss-coef", "--kl-coef", dest="kl_loss_coef", type=float, default=d.kl_loss_coef,
                   help="Coefficient of the KL loss (> 0 implies --use-kl-loss). --kl-coef is the same flag.")
    g.add_argument("--kl-loss-type", choices=KL_LOSS_TYPES, default=d.kl_loss_type,
                   help="KL estimator per token, x = lp - lp_ref: k1 = x, k2 = x^2/2, k3 = exp(-x) - 1 + x, "
                        "low_var_kl = k3 clamped to [-10, 10].")
    g.add_argument("--entropy-coef", type=float, default=d.entropy_coef,
                   help="Entropy bonus: loss -= coef * entropy of the policy (token level).")
    return parser


__all__ = ["KL_LOSS_TYPES", "LossTermsConfig", "add_loss_terms_args"]
