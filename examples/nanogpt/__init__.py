"""nanoGPT on monarch: a character-level GPT trained on Shakespeare, three ways sharing one model.

- `model.py`: the GPT (nanoGPT's shape) and its configs, `tiny` (CI, CPU) and `small` (a real GPU);
- `data.py`: the corpus split into train and validation, and batches deterministic per (seed, step, rank);
- `train.py`: `Trainer` (DDP over the default process group: gloo on CPU, NCCL on GPU) and the script,
  ``python -m examples.nanogpt.train --n_gpus 2`` (a local monarch mesh) or under ``torchrun`` (plain DDP).

`notebooks/nanogpt.ipynb` trains it in `%%mesh` cells, from a controller loop of live functions, and with the
tensor engine.
"""

from .data import Corpus, get_batch, load_corpus
from .model import CONFIGS, GPT, GPTConfig

__all__ = ["CONFIGS", "GPT", "GPTConfig", "Corpus", "get_batch", "load_corpus"]
