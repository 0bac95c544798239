#!/usr/bin/env python3
"""A small nanoGPT-like FSDP script ported to shardd, launched by torchrun.

What changed from the FSDP script: no init_process_group (the daemon does
the collectives); shardd.Client() (job, rank, world from torchrun's
environment) and shardd.nn.ShardedModule(client, model, auto_wrap={Block})
for FSDP(model, auto_wrap_policy=...); sm.no_sync(), sm.clip_grad_norm_()
and sm.state_dict_type() for FSDP's; metrics averaged with
client.all_reduce(); each rank saves its own torch.optim state dict (its
parts of the shards). The optimizer is built after wrapping, as FSDP's.

    build/shardd --socket /tmp/shardd.sock &
    SHARDD_SOCKET=/tmp/shardd.sock /usr/bin/python3 -m torch.distributed.run \
        --standalone --nproc_per_node 2 --redirects 2 --tee 2 \
        examples/train_torchrun.py --out sh.json
    /usr/bin/python3 examples/train_torchrun.py --ref --out ref.json  # plain torch, 1 process

The two print the same losses (global batch mean; relative differences
about 1e-7). --ckpt-every N saves the model (rank 0, full state dict) and
each rank's optimizer state to --ckpt-dir; --resume loads them and goes on
(in a new job: a --standalone launch is one). --opt shardd steps with
shardd.optim.AdamW (state in the daemon) instead of torch.optim.AdamW.
"""
import argparse
import contextlib
import json
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--ref", action="store_true")
p.add_argument("--steps", type=int, default=20)
p.add_argument("--accum", type=int, default=2)
p.add_argument("--batch", type=int, default=8)        # global, per micro step
p.add_argument("--ckpt-every", type=int, default=5)
p.add_argument("--eval-every", type=int, default=5)
p.add_argument("--ckpt-dir", default="/tmp/train_torchrun_ck")
p.add_argument("--resume", action="store_true")
p.add_argument("--stop-at", type=int, default=-1)     # exit there: a crash
p.add_argument("--opt", default="torch", choices=["torch", "shardd"])
p.add_argument("--out", default=None)
args = p.parse_args()

V, T, C, L, H = 64, 16, 32, 2, 4     # vocab, context, width, blocks, heads


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(C, 3 * C)
        self.proj = nn.Linear(C, C)

    def forward(self, x):
        B, T_, _ = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = [t.view(B, T_, H, C // H).transpose(1, 2) for t in (q, k, v)]
        a = (q @ k.transpose(-2, -1)) / math.sqrt(C // H)
        mask = torch.tril(torch.ones(T_, T_, dtype=torch.bool))
        a = a.masked_fill(~mask, float("-inf")).softmax(-1)
        return self.proj((a @ v).transpose(1, 2).reshape(B, T_, C))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(C)
        self.attn = Attn()
        self.ln2 = nn.LayerNorm(C)
        self.mlp = nn.Sequential(nn.Linear(C, 4 * C), nn.GELU(), nn.Linear(4 * C, C))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(V, C)
        self.wpe = nn.Embedding(T, C)
        self.blocks = nn.ModuleList([Block() for _ in range(L)])
        self.ln_f = nn.LayerNorm(C)
        self.head = nn.Linear(C, V, bias=False)
        self.head.weight = self.wte.weight              # tied
        for m in self.modules():                        # nanoGPT's init
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, V), targets.reshape(-1))


def batch(step, micro, split="train"):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + (split == "val"))
    x = torch.randint(0, V, (args.batch, T + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def lr_lambda(s, warm=3):
    if s < warm:
        return (s + 1) / warm
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, args.steps - warm)))


torch.manual_seed(0)
model = GPT()

if args.ref:
    rank, world, sm, client = 0, 1, None, None
else:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                    "client", "python"))
    import shardd
    import shardd.nn
    import shardd.optim
    client = shardd.Client()                              # torchrun's env
    rank, world = client.rank, client.world
    sm = shardd.nn.ShardedModule(client, model, auto_wrap={Block})


def rows(t):
    n = t.shape[0] // world
    return t[rank * n:(rank + 1) * n]


decay = [q for q in model.parameters() if q.dim() >= 2]
no_decay = [q for q in model.parameters() if q.dim() < 2]
groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
if args.opt == "shardd" and not args.ref:
    opt = shardd.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95))
else:
    opt = torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95))
sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)


def mean_over_ranks(v):
    return client.all_reduce(v, op="mean") if client is not None else v


def save(step):
    d = os.path.join(args.ckpt_dir, "ref" if args.ref else "shardd")
    os.makedirs(d, exist_ok=True)
    if sm is not None:
        cfg = shardd.nn.FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with sm.state_dict_type("full", cfg):
            msd = model.state_dict()                # collective: every rank
    else:
        msd = model.state_dict()
    osd = opt.state_dict()          # per rank under shardd (its parts)
    if rank == 0:
        torch.save({"model": msd, "sched": sched.state_dict(), "step": step},
                   os.path.join(d, "model.pt"))
    torch.save(osd, os.path.join(d, f"optim-r{rank}.pt"))
    if client is not None:
        client.barrier()


def load():
    d = os.path.join(args.ckpt_dir, "ref" if args.ref else "shardd")
    ck = torch.load(os.path.join(d, "model.pt"))
    model.load_state_dict(ck["model"])          # wrapped: into the shards, as FSDP's
    opt.load_state_dict(torch.load(os.path.join(d, f"optim-r{rank}.pt")))
    sched.load_state_dict(ck["sched"])
    return ck["step"]


@torch.no_grad()
def evaluate(step):
    model.eval()
    x, y = batch(step, 0, "val")
    l = float(model(rows(x), rows(y)))
    model.train()
    return mean_over_ranks(l)


start = load() if args.resume else 0
if not args.resume and args.opt == "shardd" and sm is not None and opt.steps:
    start = opt.steps                       # a relaunch of the job (same --rdzv_id)
    for _ in range(start):
        sched.step()

log = []
for step in range(start, args.steps):
    if step == args.stop_at:
        os._exit(1)
    opt.zero_grad(set_to_none=True)
    tot = 0.0
    for micro in range(args.accum):
        x, y = batch(step, micro)
        ctx = (sm.no_sync() if (sm is not None and micro < args.accum - 1)
               else contextlib.nullcontext())
        with ctx:
            loss = model(rows(x), rows(y)) / args.accum
            loss.backward()
        tot += float(loss)
    gn = (sm.clip_grad_norm_(1.0) if sm is not None
          else torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    opt.step()
    sched.step()
    tot = mean_over_ranks(tot)
    rec = {"step": step, "loss": tot, "gnorm": float(gn), "lr": sched.get_last_lr()[0]}
    if (step + 1) % args.eval_every == 0:
        rec["val"] = evaluate(step)
    if (step + 1) % args.ckpt_every == 0:
        save(step + 1)
    log.append(rec)
    if rank == 0:
        print(json.dumps(rec), flush=True)
if args.out and rank == 0:
    json.dump(log, open(args.out, "w"))
if client is not None:
    client.close()
