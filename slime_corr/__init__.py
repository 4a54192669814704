"""slime_corr: measure and correct the rollout/training log-prob mismatch in LLM RL."""

__version__ = "0.1.0"
