"""Rollout layer: the SGLang client, its samples and buffer, the stream into Megatron's data iterator, weight sync.

Import the submodules directly (``from slime_corr.rollout.client import SGLangClient``); this package
never imports Megatron or ``slime_corr.correction``.
"""
