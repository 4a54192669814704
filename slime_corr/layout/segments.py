"""Which sequence each token belongs to: the per-sequence reductions of the correction core and the losses.

The core works on 2-D token tensors and reduces per SEQUENCE only through a `Segments`:

- `Segments.rows(B, S)`: padded `[B, S]`, one sequence per row (the default; sums over the last dim);
- `Segments.packed_row(offsets, T)`: one packed row `[1, T]` (Megatron's THD layout), sequence i at this rank's
  positions `[offsets[i], offsets[i+1])`; positions from `offsets[-1]` on belong to no sequence.

Per-token math is layout-free; sums, maxima and broadcasts of per-sequence values go through here, so the padded
layout is the special case of one segment per row and runs the same kernels as without this class. Which offsets a
rank's slice has (per-sequence padding, the CP partition) is the rest of this package's business
(`micro_batch`, `context_parallel`), not the core's.
"""

from __future__ import annotations

import torch
from torch import Tensor


class Segments:
    """Per-sequence reductions over the token dim (see the module doc). `num`: the number of sequences n."""

    packed = False
    num: int

    @staticmethod
    def rows(batch: int, seq_len: int) -> Segments:
        """Padded `[batch, seq_len]`: sequence i is row i."""
        return RowSegments(batch, seq_len)

    @staticmethod
    def packed_row(offsets: Tensor, length: int) -> Segments:
        """One packed row `[1, length]`: sequence i at positions `[offsets[i], offsets[i+1])` (`offsets` [n+1],
        integers, non-decreasing from 0, the last ≤ length: checked when `offsets` is on the CPU)."""
        return PackedSegments(offsets, length)

    def shape(self) -> tuple[int, int]:
        """The 2-D token shape these segments describe."""
        raise NotImplementedError

    def sum(self, x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """Σ over each sequence's tokens: `[R, S]` -> `[n]`, `[R, k, S]` -> `[n, k]` (differentiable)."""
        raise NotImplementedError

    def amax(self, x: Tensor) -> Tensor:
        """Max over each sequence's tokens of `x` ≥ 0: `[R, S]` -> `[n]` (0 for a sequence without tokens)."""
        raise NotImplementedError

    def expand(self, v: Tensor, fill: float = 0.0) -> Tensor:
        """Per-sequence `v` [n] broadcast to the tokens: `[R, 1]` (rows) or `[1, T]` (packed; `fill` at the
        positions of no sequence)."""
        raise NotImplementedError

    def sizes(self) -> Tensor | int:
        """Positions of each sequence (padding included): `S` for rows, a `[n]` tensor when packed."""
        raise NotImplementedError

    def to_rows(self, x: Tensor) -> Tensor:
        """The tokens as padded rows `[n, L]` (one sequence per row, zero/False after its end)."""
        return x

    def from_rows(self, y: Tensor) -> Tensor:
        """Inverse of `to_rows` for `[n, L]` (or `[n, 1]`, one value per sequence) tensors."""
        return y


class RowSegments(Segments):
    """Padded rows: every reduction is over the last dim, exactly as without segments."""

    def __init__(self, batch: int, seq_len: int) -> None:
        self.num, self.seq_len = batch, seq_len

    def shape(self) -> tuple[int, int]:
        return self.num, self.seq_len

    def sum(self, x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        return x.sum(-1, dtype=dtype)

    def amax(self, x: Tensor) -> Tensor:
        return x.amax(-1) if x.shape[-1] else x.new_zeros(x.shape[:-1])

    def expand(self, v: Tensor, fill: float = 0.0) -> Tensor:
        return v.unsqueeze(-1)

    def sizes(self) -> int:
        return self.seq_len


class PackedSegments(Segments):
    """One packed row; per-sequence sums are index additions over the token ids of each sequence."""

    packed = True

    def __init__(self, offsets: Tensor, length: int) -> None:
        if offsets.dim() != 1 or offsets.numel() < 1 or offsets.is_floating_point():
            raise ValueError(f"Segments.packed_row: offsets must be a 1-D integer tensor [n+1] (cu_seqlens), got "
                             f"{offsets.dtype} {tuple(offsets.shape)}.")
        if offsets.device.type == "cpu":  # free to check here; on an accelerator it would wait for the device
            o = offsets.tolist()
            if o[0] != 0 or any(b < a for a, b in zip(o, o[1:], strict=False)) or o[-1] > length:
                raise ValueError(f"Segments.packed_row: offsets {o} must start at 0, not decrease and end at most "
                                 f"at the packed length {length}.")
        self.offsets = offsets.long()
        self.num, self.length = offsets.numel() - 1, length
        # the sequence of every position (n for positions past the last sequence: a bin that is dropped)
        self.ids = torch.searchsorted(self.offsets[1:].contiguous(),
                                      torch.arange(length, device=offsets.device), right=True)
        self._rows: tuple[Tensor, int] | None = None

    def shape(self) -> tuple[int, int]:
        return 1, self.length

    def sum(self, x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        src = x[0] if dtype is None else x[0].to(dtype)  # [T] or [k, T]
        out = src.new_zeros((*src.shape[:-1], self.num + 1)).index_add(src.dim() - 1, self.ids, src)
        return out[..., : self.num] if src.dim() == 1 else out[:, : self.num].transpose(0, 1)

    def amax(self, x: Tensor) -> Tensor:
        return x.new_zeros(self.num + 1).scatter_reduce(0, self.ids, x[0], "amax")[: self.num]

    def expand(self, v: Tensor, fill: float = 0.0) -> Tensor:
        return torch.cat([v, v.new_full((1,), fill)])[self.ids].unsqueeze(0)

    def sizes(self) -> Tensor:
        return self.offsets.diff()

    def _row_index(self) -> tuple[Tensor, int]:
        """(column of every position in its sequence's row, the longest sequence L): one device->host read."""
        if self._rows is None:
            width = int(self.sizes().max()) if self.num else 0
            col = torch.arange(self.length, device=self.ids.device) - self.offsets[self.ids]
            self._rows = col.clamp_(0, max(width - 1, 0)), width
        return self._rows

    def to_rows(self, x: Tensor) -> Tensor:
        col, width = self._row_index()
        out = x.new_zeros(self.num + 1, max(width, 1))
        out[self.ids, col] = x[0]
        return out[: self.num, :width]

    def from_rows(self, y: Tensor) -> Tensor:
        col, width = self._row_index()
        y = y.expand(self.num, width) if y.shape[-1] == 1 else y
        padded = torch.cat([y, y.new_zeros(1, y.shape[-1])]) if width else y.new_zeros(self.num + 1, 1)
        return padded[self.ids, col.clamp(max=padded.shape[-1] - 1)].unsqueeze(0)


__all__ = ["PackedSegments", "RowSegments", "Segments"]
