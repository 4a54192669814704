"""The task registry (prompts from (seed, rollout), rewards by code, prompt encoding with and without a chat
template) and the pretrained-model flags of the main job, refused at parse time naming the flag."""

from __future__ import annotations

import random

import pytest

from slime_corr.engines.embedded.model import ByteTokenizer
from slime_corr.main import main, parse_run_config
from slime_corr.trainer.config import PRETRAINED_LR
from slime_corr.trainer.task import (
    ARITHMETIC_SYSTEM,
    TASKS,
    WORDS,
    Response,
    encode_prompt,
    reward_last_integer,
    reward_lowercase,
)


@pytest.mark.parametrize("text, label, want", [
    ("7", "7", 1.0), (" 7<|im_end|>", "7", 1.0), ("3 + 4 = 7.", "7", 1.0), ("The answer is 7", "7", 1.0),
    ("7 or 8", "7", 0.0),  # the last number counts: hedging is wrong
    ("17", "7", 0.0), ("-7", "7", 0.0), ("seven", "7", 0.0), ("", "7", 0.0), ("12", "12", 1.0),
    ("3 + 4 = ", "7", 0.0),  # cut off before the result
])
def test_arithmetic_reward_is_one_when_the_last_integer_is_the_sum(text, label, want):
    assert reward_last_integer(Response(text, [1, 2], label)) == want


def test_arithmetic_prompts_depend_on_seed_and_rollout_only_and_carry_their_sum():
    task = TASKS["arithmetic"]
    a, b = task.prompts(5, 3, 16), task.prompts(5, 3, 16)
    assert a == b and a != task.prompts(5, 4, 16) and a != task.prompts(6, 3, 16)
    for p in a:
        system, user = p.messages
        assert system == {"role": "system", "content": ARITHMETIC_SYSTEM} and user["role"] == "user"
        x, plus, y = user["content"].split()
        assert plus == "+" and 0 <= int(x) <= 9 and 0 <= int(y) <= 9 and p.label == str(int(x) + int(y))
        assert len(user["content"]) <= task.max_prompt_chars


def test_lowercase_task_keeps_the_tiny_runs_prompts_and_reward():
    """The registry's `lowercase` gives the byte prompts the toy task always gave (the default run's metrics do
    not change) and scores byte tokens."""
    rng = random.Random("slime_corr-prompts-1234-7")
    before = [list(f"{rng.choice(WORDS)} {rng.randint(0, 99)}: ".encode()) for _ in range(5)]
    prompts = TASKS["lowercase"].prompts(1234, 7, 5)
    assert [encode_prompt(ByteTokenizer(), p) for p in prompts] == before
    assert reward_lowercase(Response("ab!", list(b"ab!\x00"), None)) == 0.5
    assert reward_lowercase(Response("", [], None)) == 0.0


def test_prompts_use_the_chat_template_when_the_tokenizer_has_one():
    from slime_corr.models import ChatTokenizer, cached_hf_checkpoint

    tok = ChatTokenizer.from_pretrained(cached_hf_checkpoint("smollm2-135m"))
    prompt = TASKS["arithmetic"].prompts(0, 0, 1)[0]
    ids = encode_prompt(tok, prompt)
    assert ids == tok.chat_prompt_ids(list(prompt.messages))
    text = tok.decode(ids)
    assert text.startswith(f"<|im_start|>system\n{ARITHMETIC_SYSTEM}<|im_end|>\n<|im_start|>user\n")
    assert text.endswith(f"{prompt.text}<|im_end|>\n<|im_start|>assistant\n")


def test_a_pretrained_model_sets_the_task_and_lr_defaults_and_keeps_explicit_ones():
    tiny, pretrained = parse_run_config([]).trainer, parse_run_config(["--model", "smollm2-135m"]).trainer
    assert (tiny.task, tiny.lr, tiny.model_source.is_pretrained) == ("lowercase", 1e-2, False)
    assert (pretrained.task, pretrained.lr, pretrained.model_source.model) == ("arithmetic", PRETRAINED_LR,
                                                                               "smollm2-135m")
    explicit = parse_run_config(["--model", "smollm2-135m", "--lr", "3e-5", "--task", "arithmetic"]).trainer
    assert (explicit.task, explicit.lr) == ("arithmetic", 3e-5)


BAD = [
    (["--model", "smollm2-135m", "--task", "lowercase"], {}, "--task lowercase scores byte tokens"),
    (["--model", "smollm2-135m", "--tensor-model-parallel-size", "2"], {"WORLD_SIZE": "2"},
     "--tensor-model-parallel-size=2 does not divide the model"),
    (["--model", "smollm2-135m", "--rollout-max-response-len", "8100"], {},
     "--rollout-max-response-len 8100: prompt (with up to 128 tokens of chat template) + response reach 8236"),
    (["--model", "smollm2-135m", "--hf-checkpoint", "/tmp"], {}, "both choose the model: give one"),
    (["--hf-checkpoint", "/nonexistent/llama"], {}, "--hf-checkpoint /nonexistent/llama: not a directory"),
    (["--model", "smollm2-135m", "--pipeline-model-parallel-size", "4"], {"WORLD_SIZE": "4"},
     "--pipeline-model-parallel-size 4 must divide the model's 30 layers"),
    (["--model", "smollm2-135m", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "200"], {},
     "samples of up to 136 prompt + --rollout-max-response-len 12 tokens) can take 1184 tokens"),  # 8 + 128 of template
    (["--model", "llama-7b"], {}, "argument --model: invalid choice: 'llama-7b'"),
    (["--task", "poetry"], {}, "argument --task: invalid choice: 'poetry'"),
    (["--rollout-correction-preset", "decoupled_seq_is_rs", "--rollout-correction-cuda-graph", "--device", "cpu"], {},
     "--rollout-correction-cuda-graph replays CUDA graphs, and this run is on cpu: leave it off"),
]


@pytest.mark.parametrize("argv, env, message", BAD, ids=[" ".join(a) for a, _, _ in BAD])
def test_bad_model_flags_are_refused_at_parse_time_naming_the_flag(argv, env, message, capsys, monkeypatch):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as e:
        main([*argv, "--self-check"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err, err
    if "does not divide the model" in message:
        assert "num_attention_heads=9" in err and "sizes that fit: 1, 3" in err
