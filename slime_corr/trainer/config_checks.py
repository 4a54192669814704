"""The validation of `TrainerConfig` that is not about batches and the rollout loop: the rollout engines, the model
(the tiny GPT's shape, a pretrained checkpoint's TP split and positions), pipeline parallelism and packed micro-batches,
MoE routes, the staleness bounds of asynchronous and partial rollouts, and the checkpoint to load; with the choices and
defaults the flags and the config share.

Each check is a function of the config (`check_engine(config)`, ...) that `TrainerConfig._validate`
(slime_corr.trainer.config) calls in order, and a test may call alone; every check raises `ConfigError` naming the
flag.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from slime_corr.addresses import is_this_host, url_host
from slime_corr.errors import ConfigError
from slime_corr.layout.micro_batch import packed_length
from slime_corr.mcore.checkpoint import TRACKER_FILE, iteration_dir, latest_iteration
from slime_corr.mcore.checkpoint import CheckpointError as CheckpointLoadError
from slime_corr.models.hf_checkpoint import CheckpointError, check_tensor_parallel
from slime_corr.trainer.task import TASKS

ENGINE_KINDS = ("sglang", "embedded")  # slime_corr.engines.launch.ENGINE_KINDS (not imported: no engine code here)
SGLANG_DTYPES = ("bfloat16", "float16", "float32")
WEIGHT_SYNC_MODES = ("disk", "distributed")
ROUTER_CHOICES = ("auto", "on", "off")
STALENESS_POLICIES = ("drop", "regenerate")
ENGINE_DTYPES = ("bfloat16", "float16", "float32", "float64")
PARAMS_DTYPES = ("float32", "float64")
MOE_FLAGS = ("use_rollout_routing_replay", "log_routing_mismatch", "use_routing_replay")
TINY_MOE_LR = 1e-3  # --lr's default with --model tiny-moe
PRETRAINED_LR = 1e-5  # --lr's default with a pretrained model (the tiny model's, 1e-2, would wreck it at once)
CHAT_TEMPLATE_ALLOWANCE = 128  # tokens a chat template may add around the user message (system prompt, headers)
DEFAULT_ROLLOUT_BATCH_SIZE, DEFAULT_STEPS_PER_ROLLOUT, DEFAULT_MICRO_BATCH_SIZE = 4, 4, 8


def flag_name(name: str) -> str:
    """The flag of a `TrainerConfig` field: `rollout_batch_size` -> `rollout-batch-size`."""
    return name.replace("_", "-")


def check_writable_dir(flag: str, path: str | os.PathLike[str]) -> None:
    """ConfigError unless `path` is a directory this process can write in, or can be created (its nearest existing
    ancestor is a writable directory). Probes with a temporary file: permission bits lie to root and on read-only
    mounts."""
    import tempfile

    target = Path(path)
    if target.exists() and not target.is_dir():
        raise ConfigError(f"{flag} {target}: is a file, not a directory; pass a directory (it is created if missing).")
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{flag} {target}: {existing} is a file, so the directory cannot be created there; pass "
                          "another path.")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        where = "" if existing == target else f" (it would be created in {existing})"
        raise ConfigError(f"{flag} {target}: cannot write there{where}: {e.strerror or e}; pass a directory you can "
                          "write to.") from None


def _on_another_host(url: str) -> bool:
    """`url`'s host resolves to another machine than this one (False when it does not resolve: the start-up's
    health check names that)."""
    try:
        return is_this_host(url_host(url)) is False
    except ValueError:
        return False


TrainerSettings = Any  # a TrainerConfig (not imported here: config.py imports these checks)


def check_engine(config: TrainerSettings) -> None:
    if config.rollout_engine not in ENGINE_KINDS:
        raise ConfigError(f"--rollout-engine {config.rollout_engine!r} is not one of {', '.join(ENGINE_KINDS)}.")
    launched = not config.sglang_url and config.rollout_engine == "sglang"
    passthrough = " ".join(config.sglang_server_args)
    if config.sglang_url and (config.sglang_server_args or config.sglang_python):
        what = passthrough or f"--sglang-python {config.sglang_python}"
        raise ConfigError(f"{what}: these configure the SGLang servers the trainer launches; with --sglang-url "
                          "the servers are yours (give them their flags when you start them): drop one.")
    if not config.sglang_url and config.rollout_engine == "embedded" and (config.sglang_server_args
                                                                       or config.sglang_python):
        what = passthrough or f"--sglang-python {config.sglang_python}"
        raise ConfigError(f"{what}: SGLang server flags, but --rollout-engine embedded starts no SGLang server; "
                          "use --rollout-engine sglang, or drop them.")
    if launched and config.engine_dtype not in SGLANG_DTYPES:
        raise ConfigError(f"--engine-dtype {config.engine_dtype}: the SGLang server serves "
                          f"{' or '.join(SGLANG_DTYPES)}; use --rollout-engine embedded for {config.engine_dtype}.")
    check_addresses(config)


def check_addresses(config: TrainerSettings) -> None:
    """What the engines are told must be theirs to reach: the weight sync's master address, and the folder of
    a disk sync to engines on another host (docs/scaling.md)."""
    address = config.update_weight_master_address
    if address is not None and (not address.strip() or config.rollout_weight_sync != "distributed"):
        what = "is empty" if not address.strip() else "is only used by --rollout-weight-sync distributed"
        raise ConfigError(f"--update-weight-master-address {address!r} {what}: give the trainer's address that "
                          "the engines reach with --rollout-weight-sync distributed, or drop the flag.")
    from_disk = config.rollout_weight_sync == "disk" or config.rollout_engine == "embedded"  # the first push, too
    elsewhere = [url for url in config.sglang_url if _on_another_host(url)]
    if from_disk and elsewhere and not config.work_dir:
        raise ConfigError(f"--sglang-url {elsewhere[0]} is on another host, and the engines load the trainer's "
                          "weights from disk there (--rollout-weight-sync disk, or the embedded engine's first "
                          "push): set --work-dir to a folder on storage both hosts see at the same path (a shared "
                          "file system), or use --rollout-weight-sync distributed.")


def check_precision(config: TrainerSettings) -> None:
    """--bf16 / --fp16 (checked on their own by `PrecisionConfig`) against --params-dtype."""
    precision = config.precision
    if precision.mixed and config.params_dtype != "float32":
        raise ConfigError(f"{precision.option} and --params-dtype {config.params_dtype} are exclusive: the 16-bit "
                          "model keeps fp32 main weights in the optimizer; drop one of them.")


def check_tiny_model(config: TrainerSettings) -> None:
    m = config.model
    for name in ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings"):
        value = getattr(m, name)
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"--{flag_name(name)} {value} must be an integer >= 1.")
    if m.hidden_size % m.num_attention_heads:
        raise ConfigError(f"--hidden-size {m.hidden_size} must be a multiple of --num-attention-heads "
                          f"{m.num_attention_heads}.")
    if m.vocab_size < 256:
        raise ConfigError(f"--vocab-size {m.vocab_size} must be >= 256: prompts, responses and rewards are byte "
                          "tokens.")
    if m.vocab_size % config.tensor_model_parallel_size or m.num_attention_heads % config.tensor_model_parallel_size:
        raise ConfigError(f"--tensor-model-parallel-size {config.tensor_model_parallel_size} must divide "
                          f"--vocab-size {m.vocab_size} and --num-attention-heads {m.num_attention_heads}.")
    longest = TASKS[config.task].max_prompt_chars + config.rollout_max_response_len + 2 * config.context_parallel_size
    if longest > m.max_position_embeddings:
        raise ConfigError(f"--rollout-max-response-len {config.rollout_max_response_len}: prompt + response (+ CP "
                          f"padding) reach {longest} tokens, more than --max-position-embeddings "
                          f"{m.max_position_embeddings}.")


def check_pretrained(config: TrainerSettings) -> None:
    """The checkpoint's heads, KV groups, FFN and vocabulary divide over TP; prompts (with a chat template's
    allowance) and responses fit its positions; the task reads text. Resolves the model (a shipped one is
    dequantized into the cache on first use)."""
    task = TASKS[config.task]
    if task.byte_tokens_only and not config.model_source.byte_tokens:
        raise ConfigError(f"--task {config.task} scores byte tokens (the tiny model's task); a pretrained model "
                          f"has its own tokenizer: choose one of "
                          f"{', '.join(n for n, t in TASKS.items() if not t.byte_tokens_only)}.")
    spec = config.model_source.spec()
    assert spec is not None
    try:
        check_tensor_parallel(spec, config.tensor_model_parallel_size)
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    longest = CHAT_TEMPLATE_ALLOWANCE + task.max_prompt_chars + config.rollout_max_response_len
    if longest > spec.max_position_embeddings:
        raise ConfigError(f"--rollout-max-response-len {config.rollout_max_response_len}: prompt (with up to "
                          f"{CHAT_TEMPLATE_ALLOWANCE} tokens of chat template) + response reach {longest} tokens, "
                          f"more than the model's max_position_embeddings {spec.max_position_embeddings}.")


def check_pipeline_and_packing(config: TrainerSettings) -> None:
    pp = config.pipeline_model_parallel_size
    spec = config.model_source.spec() if config.model_source.is_pretrained else None
    layers = spec.num_layers if spec else config.model.num_layers
    what = f"the model's {layers} layers" if spec else f"--num-layers {layers}"
    if layers % pp:
        raise ConfigError(f"--pipeline-model-parallel-size {pp} must divide {what}: every pipeline stage holds "
                          "the same number of layers.")
    budget = config.max_tokens_per_gpu
    if budget is not None and (not isinstance(budget, int) or budget < 1):
        raise ConfigError(f"--max-tokens-per-gpu {budget} must be an integer >= 1.")
    if config.use_dynamic_batch_size and budget is None:
        raise ConfigError("--use-dynamic-batch-size needs --max-tokens-per-gpu N: the tokens a packed "
                          "micro-batch may hold per GPU.")
    if budget is not None and not config.use_dynamic_batch_size:
        raise ConfigError(f"--max-tokens-per-gpu {budget} only applies to packed micro-batches: add "
                          "--use-dynamic-batch-size, or drop --max-tokens-per-gpu.")
    if budget is not None:
        cp = config.context_parallel_size
        prompt = TASKS[config.task].max_prompt_chars  # byte tokens; a tokenizer makes no more of ASCII text
        if config.model_source.is_pretrained and not config.model_source.byte_tokens:
            prompt += CHAT_TEMPLATE_ALLOWANCE
        group = config.n_samples_per_prompt * packed_length(prompt + config.rollout_max_response_len, cp,
                                                          config.sequence_parallel_size)
        if budget * cp < group:
            raise ConfigError(
                f"--max-tokens-per-gpu {budget}: a GRPO group (--n-samples-per-prompt {config.n_samples_per_prompt}"
                f" samples of up to {prompt} prompt + --rollout-max-response-len "
                f"{config.rollout_max_response_len} tokens) can take {group} tokens, {-(-group // cp)} per GPU "
                f"under --context-parallel-size {cp}, and a group is never split across micro-batches: use "
                f"--max-tokens-per-gpu >= {-(-group // cp)}.")


def check_routing(config: TrainerSettings) -> None:
    """Routes need a Mixture-of-Experts model. Every engine kind returns them: the SGLang servers the trainer
    launches get `--enable-return-routed-experts`, the embedded engine reads them from the HF model's routers
    (`engines.embedded.routes`), and `--sglang-url` servers must have been started with that flag (a response
    without routes is an error naming that flag). Replay works in every layout (`mcore.routing`)."""
    if config.use_routing_replay:
        check_old_routes_replay(config)
    if not config.asks_routes:
        return
    flag = "--use-rollout-routing-replay" if config.use_rollout_routing_replay else "--log-routing-mismatch"
    check_moe(config, flag)


def check_old_routes_replay(config: TrainerSettings) -> None:
    """R2 replays the routes the policy took in the trainer's own lp_old pass: one replay source, an MoE model,
    a recomputed lp_old (bypass mode, checked with the correction flags in `main`, has none either)."""
    if config.asks_routes:
        other = "--use-rollout-routing-replay" if config.use_rollout_routing_replay else "--log-routing-mismatch"
        raise ConfigError(f"--use-routing-replay (R2: replay the routes of the trainer's lp_old pass) with {other} "
                          "(the engines' routes): choose one source of routes; drop one of the two.")
    check_moe(config, "--use-routing-replay")
    if config.prox_logp_method != "recompute":
        raise ConfigError("--use-routing-replay records the routes in the recomputed lp_old pass, which "
                          f"--prox-logp-method {config.prox_logp_method} skips: use --prox-logp-method recompute, "
                          "or --use-rollout-routing-replay (the engines' routes).")


def check_moe(config: TrainerSettings, flag: str) -> None:
    spec = config.model_source.spec() if config.model_source.is_pretrained else None
    if spec is None or not spec.is_moe:
        what = f"{spec.model_type} at {spec.path}" if spec is not None else "the built-in tiny GPT"
        raise ConfigError(f"{flag}: the model is dense ({what}): routing replay and routing mismatch need a "
                          "Mixture-of-Experts model, e.g. --model tiny-moe or --hf-checkpoint of a qwen3_moe "
                          "checkpoint; drop the flag for a dense model.")


def check_load(config: TrainerSettings) -> None:
    root = Path(config.load)  # type: ignore[arg-type]
    if not root.is_dir():
        raise ConfigError(f"--load {root}: no such directory; pass the --save directory of an earlier run.")
    try:
        step = config.ckpt_step if config.ckpt_step is not None else latest_iteration(root)
    except CheckpointLoadError as e:
        raise ConfigError(f"--load {root}: {e}") from None
    if step is None:
        raise ConfigError(f"--load {root}: no {TRACKER_FILE} (no complete checkpoint was saved there).")
    if not (iteration_dir(root, step) / "metadata.json").is_file():
        saved = sorted(p.name for p in root.glob("iter_*"))
        raise ConfigError(f"--ckpt-step {step}: {iteration_dir(root, step)} is not a complete checkpoint "
                          f"(saved: {', '.join(saved) or 'none'}).")


def check_staleness(config: TrainerSettings) -> None:
    k, steps = config.max_staleness, config.num_steps_per_rollout
    if config.partial_rollout and not config.async_rollout:
        raise ConfigError("--partial-rollout: updates the weights while rollouts are in flight, but a synchronous "
                          "run has none in flight at a sync: add --async-rollout.")
    if config.mask_offpolicy_in_partial_rollout and not config.partial_rollout:
        raise ConfigError("--mask-offpolicy-in-partial-rollout masks the tokens a sample generated before a "
                          "weight update reached it mid-request, which only --partial-rollout makes: add it.")
    t = config.max_token_staleness
    if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < steps - 1):
        raise ConfigError(f"--max-token-staleness {t} must be an integer >= --num-steps-per-rollout − 1 = "
                          f"{steps - 1}: the k-th step of a rollout trains tokens k steps old, so a smaller bound "
                          "would take whole steps out of the loss.")
    if not config.async_rollout:
        for name in ("max_staleness", "staleness_policy"):
            if getattr(config, name) is not None:
                raise ConfigError(f"--{flag_name(name)} {getattr(config, name)}: bounds the asynchronous rollout "
                                  "producer, but the run is synchronous (every sample is at most "
                                  "--num-steps-per-rollout − 1 steps old): add --async-rollout or drop it.")
    if config.staleness_policy is not None and config.staleness_policy not in STALENESS_POLICIES:
        raise ConfigError(f"--staleness-policy {config.staleness_policy!r} is not one of "
                          f"{', '.join(STALENESS_POLICIES)}.")
    if k is None:
        return
    if not isinstance(k, int) or k < 0:
        raise ConfigError(f"--max-staleness {k} must be an integer >= 0 (optimizer steps).")
    if k < 2 * steps - 1:
        raise ConfigError(f"--max-staleness {k}: with --num-steps-per-rollout {steps}, a rollout generated one "
                          f"rollout ahead is trained up to {2 * steps - 1} optimizer steps after the weights that "
                          f"sampled it (A rollouts ahead: (A + 1) × {steps} − 1); use --max-staleness >= "
                          f"{2 * steps - 1}, fewer steps per rollout, or drop --async-rollout.")
