"""A character-level GPT in nanoGPT's shape: token and position embeddings, pre-LayerNorm blocks of causal
self-attention and an MLP, a final LayerNorm and a head whose weight is the token embedding's.

    model = GPT(CONFIGS["tiny"].with_vocab(codec.vocab_size))
    logits, loss = model(x, y)                # x, y: (batch, time) ids
    ids = model.generate(prompt_ids, 200)     # (1, len + 200)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """The model's shape."""

    block_size: int = 256
    """The context: the most characters the model sees at once (the position embedding's length)."""
    vocab_size: int = 128
    """How many distinct characters there are (the corpus's `CharCodec.vocab_size`: see `with_vocab`)."""
    n_layer: int = 6
    """How many transformer blocks."""
    n_head: int = 6
    """Attention heads per block; `n_embd` must divide by it."""
    n_embd: int = 384
    """The width: each position's embedding size."""
    dropout: float = 0.0
    """Dropout after attention, the MLP and the embeddings, while training (0 for a tiny model)."""
    bias: bool = False
    """Biases in the Linear and LayerNorm layers (nanoGPT: False is a little better and faster)."""

    def with_vocab(self, vocab_size: int) -> GPTConfig:
        """This config for a corpus of `vocab_size` characters."""
        return dataclasses.replace(self, vocab_size=vocab_size)


CONFIGS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=128, dropout=0.0),
    "small": GPTConfig(block_size=256, n_layer=6, n_head=6, n_embd=384, dropout=0.2),
}
"""`tiny`: trains on two CPU cores in seconds (CI); `small`: nanoGPT's shakespeare_char, for a real GPU."""


class CausalSelfAttention(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        if c.n_embd % c.n_head:
            raise ValueError(f"n_embd {c.n_embd} does not divide into {c.n_head} heads")
        self.n_head, self.dropout = c.n_head, c.dropout
        self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd, bias=c.bias)
        self.c_proj = nn.Linear(c.n_embd, c.n_embd, bias=c.bias)
        self.resid_dropout = nn.Dropout(c.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class MLP(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(c.n_embd, 4 * c.n_embd, bias=c.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * c.n_embd, c.n_embd, bias=c.bias)
        self.dropout = nn.Dropout(c.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(c.n_embd, bias=c.bias)
        self.attn = CausalSelfAttention(c)
        self.ln_2 = nn.LayerNorm(c.n_embd, bias=c.bias)
        self.mlp = MLP(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """The language model. `forward(idx, targets)` gives `(logits, loss)`; `generate` continues a prompt."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying: one matrix embeds and un-embeds
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: residual projections scaled by depth
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self) -> int:
        """Parameters, counting the tied embedding once and leaving out the position embedding (as nanoGPT)."""
        return sum(p.numel() for p in self.parameters()) - self.wpe.weight.numel()

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits for every position of `idx` (batch, time); with `targets`, the mean cross-entropy too."""
        T = idx.shape[1]
        if T > self.config.block_size:
            raise ValueError(f"a sequence of {T} is longer than the context, {self.config.block_size}")
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    def optimizer(self, lr: float, weight_decay: float, betas: tuple[float, float] = (0.9, 0.99)) -> torch.optim.AdamW:
        """AdamW with weight decay on the matrices only (not on biases and LayerNorm weights), as nanoGPT."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        fused = bool(params) and params[0].device.type == "cuda"
        return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=fused or None)

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 0.8,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """`idx` (batch, time) continued by `max_new_tokens` sampled ids; a seeded `generator` repeats it."""
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size :])
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            idx = torch.cat((idx, torch.multinomial(probs, 1, generator=generator)), dim=1)
        return idx
