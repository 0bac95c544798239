"""The model shapes people train, for tests against single-process torch.

nano_gpt(): nanoGPT / HuggingFace GPT-2's nesting: model.transformer is an
nn.ModuleDict {wte, wpe, drop, h: nn.ModuleList of Blocks, ln_f}, lm_head's
weight is tied to wte's, and the root's forward calls transformer.wte, the
blocks and ln_f directly (the ModuleDict and ModuleList have no forward of
their own). mlp(): a small nested MLP. Both are deterministic for a seed,
so every rank and the reference build the same values.
"""
import math

import torch
from torch import nn
from torch.nn import functional as F


class GPTConfig:
    def __init__(self, vocab=64, ctx=16, dim=32, heads=4, layers=2, seed=0):
        self.vocab, self.ctx, self.dim, self.heads = vocab, ctx, dim, heads
        self.layers, self.seed = layers, seed


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.heads = cfg.heads
        self.c_attn = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.c_proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x):
        b, t, d = x.shape
        h = self.heads
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // h))
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_fc = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.c_proj = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.dim)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab, cfg.dim),
            wpe=nn.Embedding(cfg.ctx, cfg.dim),
            h=nn.ModuleList([Block(cfg) for _ in range(cfg.layers)]),
            ln_f=nn.LayerNorm(cfg.dim),
        ))
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied, as nanoGPT
        for n, p in self.named_parameters():
            if n.endswith("c_proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.layers))
            elif n.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx):
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def nano_gpt(cfg=None):
    cfg = cfg or GPTConfig()
    torch.manual_seed(cfg.seed)
    return GPT(cfg)


def gpt_batch(cfg, step, rank=0, world=1, rows=4):
    """Rows of tokens for `step`; rank r of `world` takes its slice of the
    step's world*rows rows (so world ranks see exactly the reference's batch)."""
    g = torch.Generator().manual_seed(1000 + step)
    tok = torch.randint(0, cfg.vocab, (world * rows, cfg.ctx + 1), generator=g)
    mine = tok[rank * rows:(rank + 1) * rows]
    return mine[:, :-1], mine[:, 1:]


def gpt_loss(model, x, y):
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


class NestedMLP(nn.Module):
    def __init__(self, dim=16, hidden=32, depth=3):
        super().__init__()
        self.inp = nn.Linear(dim, hidden)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh())
                                     for _ in range(depth)])
        self.out = nn.Linear(hidden, dim)

    def forward(self, x):
        x = torch.tanh(self.inp(x))
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def mlp(seed=0, **kw):
    torch.manual_seed(seed)
    return NestedMLP(**kw)
