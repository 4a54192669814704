"""megatron-core's warnings that say nothing to a user of this job, filtered for the process: import this module
before anything imports megatron.core (`slime_corr.main` does, first). The test run filters the same warnings in
pyproject.toml's pytest settings."""

import warnings

# megatron-core warns on every rank, at import, that TransformerEngine and apex are missing (expected on CPU)
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed.*")
warnings.filterwarnings("ignore", message=r"full scope is deprecated")  # megatron-core 0.16's TransformerConfig
# megatron-core's tensor-parallel layers advise a CUDA setting on every TP rank, also on CPU where it means nothing
warnings.filterwarnings("ignore", message=r"When using async grad allreduce it is recommended to set the environment")
# megatron-core's dist_checkpointing loads through torch APIs that torch has deprecated (not ours to change)
warnings.filterwarnings("ignore", message=r"`load_state_dict` is deprecated and will be removed", category=FutureWarning)
warnings.filterwarnings("ignore", message=r"Please use DTensor instead and we are deprecating ShardedTensor",
                        category=FutureWarning)
