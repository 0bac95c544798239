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


# ---- LoRA (PEFT's layout) on nanoGPT ---------------------------------------

class LoRALinear(nn.Module):
    """PEFT's lora.Linear: the frozen base Linear kept as `base`, the
    trainable low-rank pair beside it (lora_A drawn as PEFT draws it,
    lora_B zero, so the wrapped layer starts as the base), dropout on the
    adapter's input."""

    def __init__(self, base, r=4, alpha=8, dropout=0.1):
        super().__init__()
        self.base = base
        self.lora_dropout = nn.Dropout(dropout)
        self.lora_A = nn.Linear(base.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base.out_features, bias=False)
        self.scale = alpha / r
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scale


LORA_TARGETS = ("c_attn", "c_proj", "c_fc")


def lora_gpt(cfg=None):
    """nanoGPT with every weight frozen (the tied embedding too) and a
    LoRALinear around each attention and MLP Linear, as
    get_peft_model(model, LoraConfig(target_modules=...)) makes it."""
    model = nano_gpt(cfg)
    model.requires_grad_(False)
    for block in model.transformer.h:
        for parent in (block.attn, block.mlp):
            for name, child in list(parent.named_children()):
                if name in LORA_TARGETS:
                    setattr(parent, name, LoRALinear(child))
    return model


def merge_lora(model, full=None):
    """PEFT's merge_and_unload() as a state dict: each base weight plus
    B @ A * scale, the adapters' keys dropped and `.base.` taken out of the
    names, so the plain nanoGPT loads it. `full` gives the parameters by
    name (a wrapped model's full_parameters()); else the model's own."""
    full = full if full is not None else {n: p.detach() for n, p in model.named_parameters()}
    merged = {}
    for name, t in full.items():
        if ".lora_" in name:
            continue
        if name.endswith(".base.weight"):
            mod = name[:-len(".base.weight")]
            scale = model.get_submodule(mod).scale
            t = t + full[mod + ".lora_B.weight"] @ full[mod + ".lora_A.weight"] * scale
        merged[name.replace(".base.", ".")] = t.clone()
    return merged


# ---- ViT (timm's VisionTransformer layout) ---------------------------------

class ViTAttention(nn.Module):
    def __init__(self, dim, heads, drop):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.attn_drop = nn.Dropout(drop)

    def forward(self, x):
        b, t, d = x.shape
        h = self.heads
        q, k, v = self.qkv(x).view(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4)
        att = self.attn_drop(((q @ k.transpose(-2, -1)) * (d // h) ** -0.5).softmax(-1))
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))


class ViTBlock(nn.Module):
    """timm's Block with layer scale: bare gamma_1 / gamma_2 parameters."""

    def __init__(self, dim, heads, drop=0.1, init_values=0.1):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = ViTAttention(dim, heads, drop)
        self.gamma_1 = nn.Parameter(init_values * torch.ones(dim))
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Dropout(drop),
                                 nn.Linear(4 * dim, dim), nn.Dropout(drop))
        self.gamma_2 = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x):
        x = x + self.gamma_1 * self.attn(self.norm1(x))
        return x + self.gamma_2 * self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, size, patch, dim):
        super().__init__()
        self.num_patches = (size // patch) ** 2
        self.proj = nn.Conv2d(3, dim, patch, patch)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class ViT(nn.Module):
    """cls_token and pos_embed bare parameters of the root, a Conv2d patch
    embedding, the cls token torch.cat'ed before the patches, timm's
    trunc_normal_ init."""

    def __init__(self, size=16, patch=4, dim=32, heads=4, depth=2, classes=10, drop=0.1):
        super().__init__()
        self.patch_embed = PatchEmbed(size, patch, dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, self.patch_embed.num_patches + 1, dim))
        self.pos_drop = nn.Dropout(drop)
        self.blocks = nn.ModuleList([ViTBlock(dim, heads, drop) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m):
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)

    def no_weight_decay(self):
        return {"pos_embed", "cls_token"}

    def forward(self, x):
        x = self.patch_embed(x)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        x = self.pos_drop(x + self.pos_embed)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x)[:, 0])


def vit(seed=0, **kw):
    torch.manual_seed(seed)
    return ViT(**kw)


def vit_param_groups(model, weight_decay):
    """timm's param_groups_weight_decay: no decay for 1-D parameters,
    biases and the model's no_weight_decay() names."""
    skip = model.no_weight_decay()
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim <= 1 or name.endswith(".bias") or name in skip:
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": no_decay, "weight_decay": 0.0},
            {"params": decay, "weight_decay": weight_decay}]


# ---- T5 (HuggingFace T5ForConditionalGeneration's layout) ------------------

class T5LayerNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class T5Attention(nn.Module):
    """HF's T5Attention: no scaling, no biases; the one holding
    relative_attention_bias (the first block's) computes the position bias
    that the stack hands to every later block."""

    def __init__(self, dim, heads, bias=False, causal=False, buckets=8, max_dist=16):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.buckets, self.max_dist = buckets, max_dist
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        if bias:
            self.relative_attention_bias = nn.Embedding(buckets, heads)

    def _bucket(self, rel):
        n = self.buckets
        ret = 0
        if not self.causal:
            n //= 2
            ret = (rel > 0).long() * n
            rel = rel.abs()
        else:
            rel = -torch.clamp(rel, max=0)
        exact = n // 2
        large = exact + (torch.log(rel.float().clamp(min=1) / exact)
                         / math.log(self.max_dist / exact) * (n - exact)).long()
        large = torch.clamp(large, max=n - 1)
        return ret + torch.where(rel < exact, rel, large)

    def compute_bias(self, q_len, k_len):
        rel = torch.arange(k_len)[None, :] - torch.arange(q_len)[:, None]
        return self.relative_attention_bias(self._bucket(rel)).permute(2, 0, 1).unsqueeze(0)

    def forward(self, x, kv=None, position_bias=None):
        b, t, d = x.shape
        kv = x if kv is None else kv
        h = self.heads
        q = self.q(x).view(b, t, h, d // h).transpose(1, 2)
        k, v = (p(kv).view(b, kv.shape[1], h, d // h).transpose(1, 2) for p in (self.k, self.v))
        if position_bias is None:
            if hasattr(self, "relative_attention_bias"):
                position_bias = self.compute_bias(t, kv.shape[1])
            else:
                position_bias = torch.zeros(1, h, t, kv.shape[1])
            if self.causal:
                keep = torch.ones(t, t, dtype=torch.bool).tril()
                position_bias = position_bias.masked_fill(~keep, float("-inf"))
        att = (q @ k.transpose(-2, -1) + position_bias).softmax(-1)
        return self.o((att @ v).transpose(1, 2).reshape(b, t, d)), position_bias


class T5Block(nn.Module):
    def __init__(self, dim, heads, decoder, first, drop=0.1):
        super().__init__()
        self.ln_self = T5LayerNorm(dim)
        self.self_attn = T5Attention(dim, heads, bias=first, causal=decoder)
        if decoder:
            self.ln_cross = T5LayerNorm(dim)
            self.cross_attn = T5Attention(dim, heads)
        self.ln_ff = T5LayerNorm(dim)
        self.wi = nn.Linear(dim, 4 * dim, bias=False)
        self.wo = nn.Linear(4 * dim, dim, bias=False)
        self.drop = nn.Dropout(drop)

    def forward(self, x, position_bias=None, enc=None):
        a, position_bias = self.self_attn(self.ln_self(x), position_bias=position_bias)
        x = x + self.drop(a)
        if enc is not None:
            x = x + self.drop(self.cross_attn(self.ln_cross(x), kv=enc)[0])
        x = x + self.drop(self.wo(self.drop(F.relu(self.wi(self.ln_ff(x))))))
        return x, position_bias


class T5Stack(nn.Module):
    """shared_bias: every Block's self-attention holds the first one's
    relative_attention_bias module and computes its bias itself (a
    parameter that modules of several Blocks hold), rather than being
    handed the first Block's bias tensor as HF's T5 does."""

    def __init__(self, embed, dim, heads, layers, decoder, shared_bias=False):
        super().__init__()
        self.embed_tokens = embed
        self.block = nn.ModuleList([T5Block(dim, heads, decoder, i == 0) for i in range(layers)])
        self.shared_bias = shared_bias
        if shared_bias:
            for blk in self.block[1:]:
                blk.self_attn.relative_attention_bias = \
                    self.block[0].self_attn.relative_attention_bias
        self.final_layer_norm = T5LayerNorm(dim)
        self.dropout = nn.Dropout(0.1)

    def forward(self, ids, enc=None):
        x = self.dropout(self.embed_tokens(ids))
        bias = None
        for blk in self.block:
            x, bias = blk(x, None if self.shared_bias else bias, enc)
        return self.dropout(self.final_layer_norm(x))


class T5(nn.Module):
    """Encoder-decoder: one `shared` embedding for both stacks and, tied
    (tie_word_embeddings), the head; the decoder's blocks cross-attend to
    the encoder's output."""

    def __init__(self, vocab=64, dim=32, heads=4, layers=2, shared_bias=False):
        super().__init__()
        self.dim = dim
        self.shared = nn.Embedding(vocab, dim)
        self.encoder = T5Stack(self.shared, dim, heads, layers, False, shared_bias)
        self.decoder = T5Stack(self.shared, dim, heads, layers, True, shared_bias)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.shared.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)) and m is not self.lm_head:
                nn.init.normal_(m.weight, std=dim ** -0.5)

    def forward(self, src, tgt_in):
        enc = self.encoder(src)
        dec = self.decoder(tgt_in, enc)
        return self.lm_head(dec * self.dim ** -0.5)


def t5(seed=0, **kw):
    torch.manual_seed(seed)
    return T5(**kw)


def seq2seq_batch(step, rank=0, world=1, rows=2, vocab=64, src_len=12, tgt_len=8):
    """(source, decoder input, target) for `step`, rank r's slice; the
    decoder input is the target shifted right after a start token 0."""
    g = torch.Generator().manual_seed(3000 + step)
    src = torch.randint(1, vocab, (world * rows, src_len), generator=g)
    tgt = torch.randint(1, vocab, (world * rows, tgt_len), generator=g)
    tgt_in = torch.cat((torch.zeros(world * rows, 1, dtype=torch.long), tgt[:, :-1]), 1)
    sl = slice(rank * rows, (rank + 1) * rows)
    return src[sl], tgt_in[sl], tgt[sl]


# ---- mixture of experts: top-k routing, a load-balancing loss ---------------

class TopKMoE(nn.Module):
    """Switch / Mixtral style: a softmax router, each token to its top-k
    experts weighted by their renormalized probabilities, and the
    load-balancing loss (experts x sum of the fraction routed to each
    times its mean probability) kept in `aux` for the trainer to add."""

    def __init__(self, dim, experts=4, k=2):
        super().__init__()
        self.k = k
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(),
                                                    nn.Linear(2 * dim, dim))
                                      for _ in range(experts)])
        self.aux = self.least = None

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = self.gate(x).softmax(-1)
        top_p, top_i = probs.topk(self.k, dim=-1)
        top_p = top_p / top_p.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        n = len(self.experts)
        for e, expert in enumerate(self.experts):
            tok, slot = (top_i == e).nonzero(as_tuple=True)
            out = out.index_add(0, tok, expert(x[tok]) * top_p[tok, slot, None])
        counts = F.one_hot(top_i, n).float().sum(1)
        self.least = int(counts.sum(0).min())  # tokens of the least used expert
        frac = counts.mean(0) / self.k
        self.aux = n * (frac * probs.mean(0)).sum()
        return out.reshape(shape)


class MoEBlock(Block):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.mlp = TopKMoE(cfg.dim)


def moe_gpt(cfg=None):
    """nanoGPT (tied embeddings) whose Blocks' MLPs are TopKMoE layers."""
    cfg = cfg or GPTConfig()
    torch.manual_seed(cfg.seed)
    model = GPT(cfg)
    torch.manual_seed(cfg.seed + 2)  # a router that sends every rank's rows to every expert
    model.transformer.h = nn.ModuleList([MoEBlock(cfg) for _ in range(cfg.layers)])
    return model


def moe_aux(model):
    """The load-balancing losses of the model's last forward, summed."""
    return sum(m.aux for m in model.modules() if isinstance(m, TopKMoE))
