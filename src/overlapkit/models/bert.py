"""A small BERT-style encoder classifier (post-norm Transformer, GELU, learned positions)."""

from __future__ import annotations

import torch
from torch import nn

PAD_ID = 0


class EncoderLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, intermediate: int, dropout: float) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(hidden, heads, dropout=dropout, batch_first=True)
        self.norm1 = nn.LayerNorm(hidden)
        self.feed_forward = nn.Sequential(
            nn.Linear(hidden, intermediate), nn.GELU(), nn.Linear(intermediate, hidden)
        )
        self.norm2 = nn.LayerNorm(hidden)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
        attended, _ = self.attention(x, x, x, key_padding_mask=padding, need_weights=False)
        x = self.norm1(x + self.dropout(attended))
        return self.norm2(x + self.dropout(self.feed_forward(x)))


class BertClassifier(nn.Module):
    """Token ids (batch, seq) -> class logits, pooled from the first token.

    Token id 0 is padding and is masked out of attention.
    """

    def __init__(
        self,
        vocab_size: int = 30522,
        hidden: int = 256,
        layers: int = 4,
        heads: int = 4,
        intermediate: int | None = None,
        max_len: int = 512,
        num_classes: int = 2,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, hidden, padding_idx=PAD_ID)
        self.position_embedding = nn.Embedding(max_len, hidden)
        self.embedding_norm = nn.LayerNorm(hidden)
        self.dropout = nn.Dropout(dropout)
        self.layers = nn.ModuleList(
            EncoderLayer(hidden, heads, intermediate or 4 * hidden, dropout) for _ in range(layers)
        )
        self.pooler = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh())
        self.classifier = nn.Linear(hidden, num_classes)
        self.max_len = max_len

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] > self.max_len:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_len {self.max_len}")
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        x = self.dropout(self.embedding_norm(x))
        # Always masked: asking whether a batch holds padding (`padding.any()`) would
        # make the host wait for the device at every forward.
        padding = tokens == PAD_ID
        for layer in self.layers:
            x = layer(x, padding)
        return self.classifier(self.pooler(x[:, 0]))
