"""Megatron-Core glue: cpu_compat (CPU adaptations), compat (megatron-core version differences), logprobs
(vocab-parallel log-probs/entropy), context_parallel (zig-zag CP helpers, groups), loss_hook (forward_step /
loss_func for get_forward_backward_func and Megatron-LM's train_step; the parts it holds: policy_log_probs
(log-probs, forward-only passes for lp_old and the reference, loglinear π_old) and step_prepass (the step's mean and
bounds)),
per_token_loss (the
calculate_per_token_loss checks), step_metrics (Megatron's reporting format), rollout_steps (the data iterator that
prepares each step inside pretrain()), megatron_lm (cross-checks with Megatron-LM's RL flags), model (tiny
GPTModel for tests/demo, emulated CP forward), params (full weights from TP shards, grad norm, optimizer step),
checkpoint (dist_checkpointing in Megatron-LM's layout). Import the submodules directly; nothing here imports megatron."""
