"""Rollout layer: SGLang client, samples, buffer, Megatron micro-batches, and the embedded local engine.

Import the submodules directly (``from slime_corr.rollout.client import SGLangClient``); this package
never imports Megatron or ``slime_corr.correction``.
"""
