"""The trainer: the main job (`python -m slime_corr.main`, `slime-corr`, `scripts/launch_torchrun.sh`). It composes
the three layers (correction math, Megatron glue, rollout) and holds no math or protocol of its own:

config   the validated `TrainerConfig` (Megatron's names for parallelism/checkpoints, slime's for rollout); its
         checks of engines, model, PP/packing, MoE and --load in config_checks, its argparse flags in flags
task     the toy task: seeded byte-level prompts, the lowercase reward
policy   `build_policy`: the model on this rank, the frozen reference, how the engines serve it
driver   rank 0's rollout side: engines, client, rollouts (sync or async), weight sync
data     a rollout -> every rank's micro-batches (GRPO advantages, whole groups per DP rank, CP slices, lags)
update   several optimizer steps per rollout through Megatron's schedule and the loss hook; baselines after rejection
checkpoint  what a resume needs (dist_checkpointing for model and optimizer, position, RNG, the pending rollout)
loop     the run: launch, loop, logging from one rank
interrupts  Ctrl-C / SIGTERM: one KeyboardInterrupt, never lost, never in the middle of a checkpoint
"""
