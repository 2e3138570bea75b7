"""A plain Vision Transformer backbone with a linear gene head: the ``h1`` architecture.

Patch embedding -> [CLS] + learned positions -> pre-norm transformer blocks -> final norm ->
CLS token = tile embedding -> linear head = gene expression. Written with
``scaled_dot_product_attention`` and no data-dependent control flow, so ``torch.export`` traces it
with a dynamic batch dimension.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["VIT_SIZES", "GeneViT", "ViTConfig"]


@dataclass(frozen=True)
class ViTConfig:
    tile_size: int = 224
    patch_size: int = 16
    dim: int = 96
    depth: int = 2
    heads: int = 3
    mlp_ratio: float = 2.0

    def as_dict(self) -> dict[str, int | float]:
        return asdict(self)


VIT_SIZES: dict[str, ViTConfig] = {
    # Fast enough for tests: 64 tiles well under a second on 2 CPU cores.
    "tiny": ViTConfig(dim=96, depth=2, heads=3, mlp_ratio=2.0),
    # ViT-S/16: a realistic CPU cost (~4.6 GFLOPs a tile).
    "small": ViTConfig(dim=384, depth=12, heads=6, mlp_ratio=4.0),
    # ViT-L/16: for the GPU check only.
    "large": ViTConfig(dim=1024, depth=24, heads=16, mlp_ratio=4.0),
}


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: float):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        hidden = int(dim * mlp_ratio)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        qkv = self.qkv(self.norm1(x)).reshape(b, n, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        attn = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, n, d))
        out: torch.Tensor = x + self.fc2(F.gelu(self.fc1(self.norm2(x))))
        return out


class GeneViT(nn.Module):
    """``[B, 3, T, T]`` normalized tiles -> ``(predictions [B, G], embedding [B, D])``."""

    def __init__(self, config: ViTConfig, num_genes: int):
        super().__init__()
        if config.tile_size % config.patch_size:
            raise ValueError("tile_size must be a multiple of patch_size")
        self.config = config
        d = config.dim
        n_patches = (config.tile_size // config.patch_size) ** 2
        self.patch_embed = nn.Conv2d(3, d, config.patch_size, stride=config.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.pos_embed = nn.Parameter(torch.zeros(1, n_patches + 1, d))
        self.blocks = nn.ModuleList(
            _Block(d, config.heads, config.mlp_ratio) for _ in range(config.depth)
        )
        self.norm = nn.LayerNorm(d, eps=1e-6)
        self.gene_head = nn.Linear(d, num_genes)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self.patch_embed(x).flatten(2).transpose(1, 2)
        cls = self.cls_token.expand(tokens.shape[0], -1, -1)
        h = torch.cat([cls, tokens], dim=1) + self.pos_embed
        for block in self.blocks:
            h = block(h)
        embedding = self.norm(h)[:, 0]
        return self.gene_head(embedding), embedding

    @torch.no_grad()
    def init_seeded(self, seed: int) -> GeneViT:
        """Deterministic, *untrained* weights (truncated normal, ViT-style)."""
        gen = torch.Generator().manual_seed(seed)
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                param.zero_()
            elif "norm" in name:
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen).clamp_(-2, 2) * 0.02)
        return self
