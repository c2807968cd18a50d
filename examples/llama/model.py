"""A Llama-style decoder: RMSNorm, rotary position embeddings, SwiGLU feed-forward, grouped-query attention.

`CONFIGS` names the sizes: `tiny` (2 layers; what CI trains on CPU), `small` (for one real GPU) and the seed's
`llama2_7b` / `llama2_13b` (as Meta published them; built on the meta device unless a GPU host has room).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelArgs:
    """The shape of a Llama model."""

    dim: int = 4096
    """Width of the residual stream."""
    n_layers: int = 32
    """Transformer blocks."""
    n_heads: int = 32
    """Query heads per attention layer."""
    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None: as many as `n_heads`."""
    vocab_size: int = 32000
    """Token ids are below this."""
    multiple_of: int = 256
    """The feed-forward width is rounded up to a multiple of this."""
    ffn_dim_multiplier: float | None = None
    """Scales the feed-forward width (Llama 2 70B uses 1.3)."""
    norm_eps: float = 1e-5
    """RMSNorm's epsilon."""
    rope_theta: float = 10000.0
    """Base of the rotary embedding's frequencies."""
    max_seq_len: int = 4096
    """Longest sequence the rotary table covers."""

    def __post_init__(self) -> None:
        kv = self.n_kv_heads or self.n_heads
        if self.dim % self.n_heads or self.n_heads % kv:
            raise ValueError(
                f"ModelArgs(dim={self.dim}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}): "
                "dim must divide by n_heads and n_heads by n_kv_heads"
            )


CONFIGS: dict[str, ModelArgs] = {
    "tiny": ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32, max_seq_len=256),
    "small": ModelArgs(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=128, multiple_of=64, max_seq_len=1024),
    "llama2_7b": ModelArgs(dim=4096, n_layers=32, n_heads=32),
    "llama2_13b": ModelArgs(dim=5120, n_layers=40, n_heads=40),
}
"""Model sizes by name (`--model_name`)."""


def model_args(name: str, **overrides) -> ModelArgs:
    """The named configuration, with fields replaced (`vocab_size=` for a tokenizer's size)."""
    if name not in CONFIGS:
        raise ValueError(f"model_name={name!r}: the models are {', '.join(CONFIGS)}")
    return replace(CONFIGS[name], **overrides)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_table(head_dim: int, seq_len: int, theta: float) -> torch.Tensor:
    """cos and sin of each position's rotation angles, shape (seq_len, head_dim // 2, 2)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(seq_len).float(), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rotary(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate each pair of `x`'s last dimension (batch, seq, heads, head_dim) by its position's angle."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    cos, sin = table[: x.shape[1], None, :, 0], table[: x.shape[1], None, :, 1]
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads or args.n_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = apply_rotary(self.wq(x).view(b, s, self.n_heads, self.head_dim), rope)
        k = apply_rotary(self.wk(x).view(b, s, self.n_kv_heads, self.head_dim), rope)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim)
        repeat = self.n_heads // self.n_kv_heads  # grouped-query: each key/value head serves `repeat` queries
        k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        hidden = int(2 * 4 * args.dim / 3)
        if args.ffn_dim_multiplier is not None:
            hidden = int(args.ffn_dim_multiplier * hidden)
        hidden = args.multiple_of * math.ceil(hidden / args.multiple_of)
        self.w1 = nn.Linear(args.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """The decoder: `model(tokens)` gives logits; `model(tokens, targets)` the mean cross-entropy."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer(
            "rope", rotary_table(args.dim // args.n_heads, args.max_seq_len, args.rope_theta), persistent=False
        )

    def init_weights(self, seed: int = 0) -> None:
        """Seeded initialisation (normal, std 0.02; norms to one): every rank builds the same model."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.rope)
        logits = self.output(self.norm(h)).float()
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
