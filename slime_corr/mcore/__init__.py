"""Megatron-Core glue: cpu_compat (CPU adaptations), logprobs (vocab-parallel log-probs/entropy),
context_parallel (zig-zag CP helpers, groups), loss_hook (forward_step/loss_func for get_forward_backward_func),
model (tiny GPTModel for tests/demo). Import the submodules directly; nothing here imports megatron."""
