"""docs/usage.md's custom weighting function example, loaded by path through the flag, against hand computation."""

import argparse
import math
from pathlib import Path

import torch

from slime_corr.arguments import add_rollout_correction_args, parse_rollout_correction_config
from slime_corr.correction import compute_rollout_correction

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_tis.py"


def test_example_function_loads_from_the_flag_and_computes_its_formula():
    parser = add_rollout_correction_args(argparse.ArgumentParser())
    _, config = parse_rollout_correction_config(parser, [
        "--use-tis", "--tis-upper-bound", "2.0",
        "--custom-tis-function-path", f"{EXAMPLE}:length_aware_geometric_is",
    ])
    # Sequence 0: 4 tokens, mean log-ratio 0.1 (kept: 0.1 <= log 2 / 2); sequence 1: 1 token, lr 1.0
    # (rejected: 1.0 > log 2); sequence 2: empty.
    rollout = torch.zeros(3, 5)
    train = torch.tensor([[0.1, 0.2, 0.0, 0.1, 9.0], [1.0, 0, 0, 0, 0], [0, 0, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.float32)
    out = compute_rollout_correction(train, rollout, mask, config)
    expected_w0 = math.exp(0.1)
    assert torch.allclose(out.weights[0, :4], torch.full((4,), expected_w0))
    assert out.weights[0, 4] == 0 and torch.all(out.weights[2] == 0)
    assert out.loss_mask[0].tolist() == [1, 1, 1, 1, 0]
    assert out.loss_mask[1].sum() == 0  # rejected by the function
    assert out.metrics["custom_rejected_seq_fraction"].item() == 0.5
