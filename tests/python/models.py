"""The model shapes people train, for tests against single-process torch.

nano_gpt(): nanoGPT / HuggingFace GPT-2's nesting: model.transformer is an
nn.ModuleDict {wte, wpe, drop, h: nn.ModuleList of Blocks, ln_f}, lm_head's
weight is tied to wte's, and the root's forward calls transformer.wte, the
blocks and ln_f directly (the ModuleDict and ModuleList have no forward of
their own). llama(): HuggingFace LlamaForCausalLM's nesting: model.model
(a LlamaModel with a forward of its own: embed_tokens, layers: a ModuleList
of DecoderLayers, norm, the rotary frequencies as a buffer) and lm_head,
untied unless asked; RMSNorm, rotary positions, SwiGLU MLP, no biases.
resnet(): torchvision's ResNet-18 layout (conv1, bn1, maxpool, layer1-4 of
2 BasicBlocks each, the first of layer2-4 with a 1x1 downsample, avgpool,
fc), BatchNorm everywhere (running statistics: buffers, not parameters),
with `width` channels where torchvision has 64. mlp(): a small nested MLP.
All are deterministic for a seed, so every rank and the reference build
the same values.
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


# ---- LLaMA (HuggingFace LlamaForCausalLM's layout) ------------------------

class LlamaConfig:
    def __init__(self, vocab=64, ctx=16, dim=32, heads=4, layers=2, hidden=None,
                 tie=False, seed=0):
        self.vocab, self.ctx, self.dim, self.heads = vocab, ctx, dim, heads
        self.layers, self.tie, self.seed = layers, tie, seed
        # LLaMA's 2/3 of 4*dim, rounded up to a multiple of 16
        self.hidden = hidden or (2 * 4 * dim // 3 + 15) // 16 * 16


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype)


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.heads = cfg.heads
        self.q_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.o_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        h = self.heads
        q, k, v = (p(x).view(b, t, h, d // h).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // h))
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        return self.o_proj((att @ v).transpose(1, 2).reshape(b, t, d))


class LlamaMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.down_proj = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList([LlamaDecoderLayer(cfg) for _ in range(cfg.layers)])
        self.norm = RMSNorm(cfg.dim)
        hd = cfg.dim // cfg.heads
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd)),
                             persistent=False)

    def forward(self, idx):
        t = idx.shape[1]
        f = torch.outer(torch.arange(t, device=idx.device).float(), self.inv_freq)
        emb = torch.cat((f, f), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class Llama(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        if cfg.tie:
            self.lm_head.weight = self.model.embed_tokens.weight
        for m in self.modules():  # HF's _init_weights
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx):
        return self.lm_head(self.model(idx))


def llama(cfg=None):
    cfg = cfg or LlamaConfig()
    torch.manual_seed(cfg.seed)
    return Llama(cfg)


# ---- ResNet-18 (torchvision's layout, `width` channels for its 64) --------

class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            nn.BatchNorm2d(cout))

    def forward(self, x):
        idt = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + idt)


class ResNet(nn.Module):
    def __init__(self, width=8, classes=10):
        super().__init__()
        w = width
        self.conv1 = nn.Conv2d(3, w, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(w)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        chans = [w, 2 * w, 4 * w, 8 * w]
        cin = w
        for i, c in enumerate(chans):
            stride = 1 if i == 0 else 2
            setattr(self, "layer%d" % (i + 1),
                    nn.Sequential(BasicBlock(cin, c, stride), BasicBlock(c, c)))
            cin = c
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8 * w, classes)
        for m in self.modules():  # torchvision's init
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for i in range(1, 5):
            x = getattr(self, "layer%d" % i)(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet(width=8, classes=10, seed=0):
    torch.manual_seed(seed)
    return ResNet(width, classes)


def image_batch(step, rank=0, world=1, rows=4, size=32, classes=10):
    """Images and labels for `step`; rank r of `world` takes its slice of
    the step's world*rows rows."""
    g = torch.Generator().manual_seed(2000 + step)
    x = torch.randn(world * rows, 3, size, size, generator=g)
    y = torch.randint(0, classes, (world * rows,), generator=g)
    return x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
