"""The corpus as ids, split into train and validation, and batches of it.

A batch depends only on (seed, step, rank), never on what ran before, so every way of training (a `%%mesh`
cell, a live function, the tensor engine, torchrun) sees the same data at the same step, and a run can be
cut into chunks or resumed without changing it.

    corpus = load_corpus()                                  # all of Shakespeare: 90% train, 10% validation
    x, y = get_batch(corpus.train, 32, 64, seed=1337, step=0, rank=0)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .. import shakespeare


@dataclass
class Corpus:
    """The encoded text: `train` and `val` are 1-D int64 tensors of ids; `codec` maps ids to characters."""

    train: torch.Tensor
    val: torch.Tensor
    codec: shakespeare.CharCodec

    @property
    def vocab_size(self) -> int:
        return self.codec.vocab_size


def load_corpus(plays: list[str] | None = None, val_fraction: float = 0.1) -> Corpus:
    """The plays named (all 38 by default) as ids; the last `val_fraction` of the text is held out for
    validation (as nanoGPT's shakespeare_char). The vocabulary is every character of the text."""
    text = shakespeare.text(plays)
    codec = shakespeare.CharCodec(text)
    data = codec.encode(text)
    n = int(len(data) * (1 - val_fraction))
    return Corpus(train=data[:n], val=data[n:], codec=codec)


def batch_generator(seed: int, step: int, rank: int) -> torch.Generator:
    """A torch generator seeded from (seed, step, rank) alone (numpy's SeedSequence mixes them)."""
    state = np.random.SeedSequence([seed, step, rank]).generate_state(2, dtype=np.uint64)
    return torch.Generator().manual_seed(int(state[0] >> np.uint64(1)))


def get_batch(
    data: torch.Tensor,
    batch_size: int,
    block_size: int,
    *,
    seed: int,
    step: int,
    rank: int,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch_size` random windows of `block_size` ids from `data`, and the same windows one id later (the
    targets): `(x, y)`, each (batch_size, block_size) int64 on `device`. The same arguments give the same
    batch, on any process."""
    starts = torch.randint(len(data) - block_size - 1, (batch_size,), generator=batch_generator(seed, step, rank))
    offsets = starts[:, None] + torch.arange(block_size + 1)
    window = data[offsets]
    x, y = window[:, :-1], window[:, 1:]
    if torch.device(device).type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.contiguous(), y.contiguous()
