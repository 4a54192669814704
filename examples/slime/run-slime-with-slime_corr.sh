#!/bin/bash
# The lines of slime's run-qwen3-4b-mis.sh (examples/train_infer_mismatch_helper) that involve rollout
# correction, with slime_corr as the TIS function. Needs `pip install slime_corr` in slime's environment.
# Paste into slime's script; the rest of it (CKPT_ARGS, ROLLOUT_ARGS, PERF_ARGS, ...) is unchanged.

GRPO_ARGS=(
   --advantage-estimator grpo
   --use-kl-loss
   --kl-loss-coef 0.00
   --kl-loss-type low_var_kl
   --entropy-coef 0.00
   --eps-clip 0.2
   --eps-clip-high 0.28
   --use-tis                      # slime's switch: correction on
)

CUSTOM_ARGS=(
   --custom-config-path examples/slime/mis.yaml        # slime's mis.yaml, unchanged
   # was: examples.train_infer_mismatch_helper.mis.compute_mis_weights_with_cp
   --custom-tis-function-path slime_corr.integrations.slime.compute_mis_weights_with_cp
)

# slime's default TIS or IcePop instead (no YAML needed; --tis-clip / --tis-clip-low are the bounds):
#   --custom-tis-function-path slime_corr.integrations.slime.vanilla_tis_function
#   --custom-tis-function-path slime_corr.integrations.slime.icepop_function
# Metric names: the hook returns slime's mis_* keys and slime_corr's; `metric_names: slime` in the YAML keeps
# only slime's.

echo "python3 train.py ... ${GRPO_ARGS[*]} ${CUSTOM_ARGS[*]}"
