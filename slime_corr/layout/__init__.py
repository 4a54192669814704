"""The sequence layout, in one place: how samples become Megatron micro-batches and how a rank sees them.

- `micro_batch`: the micro-batch contract (padded rows or one packed THD row), building it from samples, padding,
  the samples that are not trained, the TP broadcast;
- `context_parallel`: the zig-zag / THD slice each CP rank holds, and the sequences of that slice;
- `segments`: which sequence each token belongs to, for the correction core's per-sequence reductions;
- `groups`: GRPO advantages per group, dealing samples to DP ranks, packing groups into token budgets.

Torch only: no Megatron, no HTTP. The trainer, the Megatron glue (`slime_corr.mcore`) and the rollout's stream into
Megatron's data iterator import it; it imports nothing of theirs (the rollout's `Sample` record aside).
"""
