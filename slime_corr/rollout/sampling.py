"""Per-request sampling seeds: ``sampling_seed`` values derived from (run seed, rollout, sample) by a fixed
hash, so a rollout's requests are reproducible wherever the engine honours the seed (the embedded engine always; the
real SGLang server only under deterministic inference, which has no CPU backend)."""

from __future__ import annotations

_MASK63 = (1 << 63) - 1


def mix_seed(seed: int, position: int) -> int:
    """A 63-bit seed from (seed, position): splitmix64 finalizer of ``seed * golden + position``."""
    z = (int(seed) * 0x9E3779B97F4A7C15 + int(position) + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _MASK63
