#!/usr/bin/env python3
"""Train a small GPT through shardd with the plain torch loop, one process per rank.

    make && python3 examples/train_gpt.py --ranks 2 --steps 40 --start-daemon

The model is GPT-2 shaped: token and position embeddings, pre-norm blocks
(LayerNorm, causal self-attention, GELU MLP), a final LayerNorm and an
output layer whose weight *is* the token embedding (tied). Every block is a
direct child of the model, so ``auto_wrap="children"`` makes one unit (flat
buffer) per block; the tied weight belongs to the root's unit (FSDP's rule).

Each rank is a process (multiprocessing, forkserver) with its own shardd
connection and transient areas (FSDP's reshard: the module's hooks gather,
reduce-scatter and release each unit). The recipe is the usual one:

    shardd.optim.AdamW, two groups (no weight decay for biases and norms),
    warmup + cosine torch.optim.lr_scheduler.LambdaLR,
    sm.clip_grad_norm_ (FSDP's: over every shard), and --accum backwards
    per step (gradient accumulation), each on 1/accum of the rank's slice

    for step in range(opt.steps, steps):
        opt.zero_grad()
        for micro in range(accum):
            (loss_fn(model(x), y) / accum).backward()
        sm.clip_grad_norm_(clip)
        opt.step()
        sched.step()

With mean reduction and equal slices the N-rank run computes what one
process computes on the global batch with torch.optim.AdamW (--check runs
that and prints the largest relative loss difference).

Resume: the daemon keeps the shards, the optimizer state and the step
count. Relaunching the same command with the same --job after the ranks
died (kill -9, a node's trainer crash) attaches to them and continues at
the daemon's step count (``opt.steps``); the data of a step and the
schedule depend on the step number only, so the run continues as if never
interrupted. --checkpoint-every K writes a daemon checkpoint every K steps
to DIR/step-NNNNNN (``sm.checkpoint``, a job collective every rank calls
after its step); --restore DIR recreates the
job from one (in a daemon that does not hold it) and continues from there.

--bf16: the parameters are bf16 (forward and backward compute in bf16, the
loss in fp32) and the daemon's AdamW steps an fp32 master of each shard,
seeded from the exact fp32 initial values, as FSDP's mixed precision with
bf16 parameters; gradients are reduced and accumulated in fp32. --check
then compares with one process keeping fp32 master weights, copying them
into a bf16 model every step and accumulating its gradients in fp32.

Without --start-daemon the daemon at --socket (else $SHARDD_SOCKET, else
/run/shardd/shardd.sock) is used; with it, build/shardd (or $SHARDD_BIN) is
started on a temporary socket with the host backend and stopped at the end.
"""
import argparse
import math
import multiprocessing as mp
import os
import queue
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def import_shardd():
    try:
        import shardd  # noqa: F401
    except ImportError:
        sys.path.insert(0, os.path.join(REPO, "client", "python"))
    import shardd
    import shardd.daemon
    return shardd


# ---- model ---------------------------------------------------------------------

def make_model(cfg):
    """The GPT every rank (and the reference) builds: same seed, same values."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            # no qkv bias: a key bias gets a gradient that is zero but for
            # rounding (softmax ignores a shift shared by all keys), and
            # Adam turns such noise into full-size steps of either sign, so
            # two correct summation orders would look like a divergence
            self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
            self.proj = nn.Linear(cfg.dim, cfg.dim)

        def forward(self, x):
            b, t, d = x.shape
            h = cfg.heads
            q, k, v = self.qkv(x).split(d, dim=2)
            q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // h))
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~causal, float("-inf")).softmax(dim=-1)
            return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(cfg.dim)
            self.attn = Attention()
            self.ln2 = nn.LayerNorm(cfg.dim)
            self.fc = nn.Linear(cfg.dim, 4 * cfg.dim)
            self.proj = nn.Linear(4 * cfg.dim, cfg.dim)

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.proj(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(cfg.vocab, cfg.dim)
            self.wpe = nn.Embedding(cfg.ctx, cfg.dim)
            # blocks are direct children (h0, h1, ...); a ModuleList of them
            # (nanoGPT's transformer.h) gives the same units, as
            # auto_wrap="children" descends through containers
            for i in range(cfg.layers):
                self.add_module("h%d" % i, Block())
            self.ln_f = nn.LayerNorm(cfg.dim)
            self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
            self.lm_head.weight = self.wte.weight
            self._init()

        def _init(self):
            # GPT-2's: N(0, 0.02), residual projections scaled down by depth
            for n, p in self.named_parameters():
                if n.endswith("bias"):
                    nn.init.zeros_(p)
                elif ".ln" in n or n.startswith("ln_f"):
                    nn.init.ones_(p)
                elif n.endswith("proj.weight"):
                    nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.layers))
                else:
                    nn.init.normal_(p, std=0.02)

        def forward(self, idx):
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.wte(idx) + self.wpe(pos)
            for i in range(cfg.layers):
                x = getattr(self, "h%d" % i)(x)
            return self.lm_head(self.ln_f(x))

    torch.manual_seed(cfg.seed)
    return GPT()


def param_groups(model, cfg):
    """GPT's two groups: weight decay for the matrices and embeddings, none
    for biases and LayerNorms. By module type and name, not by shape:
    between uses a transient ShardedModule's parameters are their 1-D parts
    of this rank's shard (possibly empty), so ``p.shape`` is the part's
    (``p.dim()`` stays the original's, so a split by it would work too)."""
    from torch import nn
    decay, no_decay, seen = [], [], set()
    for _, m in model.named_modules():
        for n, p in m.named_parameters(recurse=False):
            if id(p) in seen:  # the tied weight, met again as lm_head.weight
                continue
            seen.add(id(p))
            if isinstance(m, nn.LayerNorm) or n == "bias":
                no_decay.append(p)
            else:
                decay.append(p)
    return [{"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def lr_lambda(cfg):
    """Linear warmup over --warmup steps, then cosine to --min-lr-ratio."""
    def f(step):
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        t = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))
    return f


def make_optimizer(model, cfg, optim):
    """AdamW from torch.optim or shardd.optim, the same arguments (torch's
    single-tensor path: the daemon's kernel follows it)."""
    return optim.AdamW(param_groups(model, cfg), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                       eps=cfg.eps, foreach=False)


def make_scheduler(opt, cfg, start=0):
    """Warmup + cosine LambdaLR; start: steps already done (a resume)."""
    import torch
    if start:
        # LambdaLR resumes from last_epoch, which needs the base lr recorded
        for g in opt.param_groups:
            g.setdefault("initial_lr", g["lr"])
    return torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg), last_epoch=start - 1)


# ---- data ----------------------------------------------------------------------

def make_data(cfg):
    """Tokens (steps, batch, ctx + 1), seeded: each sequence follows a fixed
    random permutation of the vocabulary, with --noise of the tokens drawn
    at random, so there is something to learn. Inputs are [:, :-1], targets
    [:, 1:]. A step's data depends on the step only (resume)."""
    import torch
    g = torch.Generator().manual_seed(cfg.seed + 1)
    perm = torch.randperm(cfg.vocab, generator=g)
    n = cfg.steps * cfg.batch
    tok = torch.empty(n, cfg.ctx + 1, dtype=torch.long)
    tok[:, 0] = torch.randint(0, cfg.vocab, (n,), generator=g)
    for t in range(1, cfg.ctx + 1):
        rnd = torch.randint(0, cfg.vocab, (n,), generator=g)
        keep = torch.rand(n, generator=g) >= cfg.noise
        tok[:, t] = torch.where(keep, perm[tok[:, t - 1]], rnd)
    return tok.view(cfg.steps, cfg.batch, cfg.ctx + 1)


def micro_rows(cfg, rank, k):
    """Rows of a step's global batch that rank's k-th micro-batch trains on."""
    per = cfg.batch // cfg.ranks
    mb = per // cfg.accum
    lo = rank * per + k * mb
    return lo, lo + mb


def lm_loss(model, tok):
    from torch.nn import functional as F
    logits = model(tok[:, :-1]).float()  # bf16 compute: the loss in fp32
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tok[:, 1:].reshape(-1))


def reference_train(cfg):
    """One process, the global batch, torch.optim.AdamW, the same recipe:
    the k-th micro-batch is every rank's k-th. -> (losses, norms, lrs, params)."""
    if cfg.bf16:
        return reference_train_bf16(cfg)
    import torch
    torch.set_num_threads(1)
    model = make_model(cfg)
    tok = make_data(cfg)
    opt = make_optimizer(model, cfg, torch.optim)
    sched = make_scheduler(opt, cfg)
    losses, norms, lrs = [], [], []
    for s in range(cfg.steps):
        opt.zero_grad()
        total = 0.0
        for k in range(cfg.accum):
            rows = torch.cat([torch.arange(*micro_rows(cfg, r, k)) for r in range(cfg.ranks)])
            loss = lm_loss(model, tok[s][rows]) / cfg.accum
            loss.backward()
            total += loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)))
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        losses.append(total)
    params = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    return losses, norms, lrs, params


def reference_train_bf16(cfg):
    """--bf16's reference: torch.optim.AdamW over fp32 master weights,
    copied into a bf16 model every step, whose bf16 gradients are
    accumulated in fp32 into the masters' (the mixed precision the daemon
    keeps). -> as reference_train, params the bf16 model's (as fp32)."""
    import torch
    torch.set_num_threads(1)
    master = make_model(cfg)
    half = make_model(cfg).to(torch.bfloat16)  # .to keeps the tie
    tok = make_data(cfg)
    opt = make_optimizer(master, cfg, torch.optim)
    sched = make_scheduler(opt, cfg)
    pairs = list(zip(master.parameters(), half.parameters()))
    losses, norms, lrs = [], [], []
    for s in range(cfg.steps):
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for m, h in pairs:
                h.copy_(m)
        total = 0.0
        for k in range(cfg.accum):
            half.zero_grad(set_to_none=True)
            rows = torch.cat([torch.arange(*micro_rows(cfg, r, k)) for r in range(cfg.ranks)])
            loss = lm_loss(half, tok[s][rows]) / cfg.accum
            loss.backward()
            total += loss.item()
            for m, h in pairs:
                g = h.grad.float()
                m.grad = g if m.grad is None else m.grad + g
        norms.append(float(torch.nn.utils.clip_grad_norm_(master.parameters(), cfg.clip)))
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        losses.append(total)
    params = {n: p.detach().bfloat16().float().numpy().copy()
              for n, p in master.named_parameters()}
    return losses, norms, lrs, params


# ---- one rank ------------------------------------------------------------------

def rank_main(rank, cfg, socket, q):
    try:
        import torch
        torch.set_num_threads(1)
        shardd = import_shardd()
        import shardd.nn
        import shardd.optim
        with warnings.catch_warnings():
            # run() says "resuming at step N" once; the client's warning per
            # rank would add "a new run needs a job name of its own" to a
            # resume the user asked for (--job of a killed run, --restore)
            warnings.simplefilter("ignore", shardd.ResumedJobWarning)
            client = shardd.Client(socket, job=cfg.job, rank=rank, world=cfg.ranks,
                                   transient_areas=True,
                                   client_name="train_gpt rank %d" % rank)
        model = make_model(cfg)
        tok = make_data(cfg)
        # attaches to the job's shards when they exist (a relaunch, a restore)
        sm = shardd.nn.ShardedModule(client, model, auto_wrap="children",
                                     dtype="bf16" if cfg.bf16 else None)
        opt = make_optimizer(model, cfg, shardd.optim)
        start = opt.steps
        sched = make_scheduler(opt, cfg, start)
        dev = sm.device
        q.put(("start", rank, start, [(u.name, u.buffer.numel) for u in sm.units]))
        for s in range(start, cfg.steps):
            t0 = time.monotonic()
            opt.zero_grad()
            total = 0.0
            for k in range(cfg.accum):
                lo, hi = micro_rows(cfg, rank, k)
                loss = lm_loss(model, tok[s, lo:hi].to(dev)) / cfg.accum
                loss.backward()
                total += loss.item()
            norm = float(sm.clip_grad_norm_(cfg.clip))
            lr = opt.param_groups[0]["lr"]
            opt.step()
            sched.step()
            if opt.last_step.step != s + 1:
                raise RuntimeError("daemon step count %d, expected %d"
                                   % (opt.last_step.step, s + 1))
            q.put(("step", rank, s, total, norm, lr, time.monotonic() - t0))
            if cfg.checkpoint_every and (s + 1) % cfg.checkpoint_every == 0:
                # a job collective: every rank asks, the daemon takes it once
                # all have, after their step, and answers all when written
                d = os.path.join(cfg.checkpoint_dir, "step-%06d" % (s + 1))
                sm.checkpoint(d)
                if rank == 0:
                    q.put(("checkpoint", rank, s + 1, d))
            if cfg.step_delay:
                time.sleep(cfg.step_delay)
        params = sm.full_parameters()
        if rank == 0:
            q.put(("params", rank, {n: t.float().cpu().numpy().copy()
                                    for n, t in params.items()}))
        client.close()
        q.put(("done", rank))
    except BaseException as e:  # report, then fail the process
        import traceback
        q.put(("error", rank, "%s\n%s" % (e, traceback.format_exc())))
        raise SystemExit(1)


# ---- driver --------------------------------------------------------------------

def check_cfg(cfg):
    if cfg.batch % (cfg.ranks * cfg.accum):
        raise ValueError("--batch %d is not a multiple of --ranks %d x --accum %d"
                         % (cfg.batch, cfg.ranks, cfg.accum))
    if cfg.dim % cfg.heads:
        raise ValueError("--dim %d is not a multiple of --heads %d" % (cfg.dim, cfg.heads))
    if cfg.checkpoint_every and not cfg.checkpoint_dir:
        raise ValueError("--checkpoint-every needs --checkpoint-dir")
    if cfg.checkpoint_dir and not os.path.isabs(cfg.checkpoint_dir):
        # the daemon writes it: a path of the daemon's machine
        cfg.checkpoint_dir = os.path.abspath(cfg.checkpoint_dir)


def run(cfg, socket, log=print, timeout=600.0, on_start=None, on_step=None):
    """Spawns cfg.ranks rank processes against the daemon at socket.
    on_start(procs) once they run, on_step(step) after each step every rank
    finished (a test kills the ranks from there).
    -> dict(start, losses, norms, lrs (from start on; None for steps before),
    params, units, checkpoints, train_s, wall_s)."""
    check_cfg(cfg)
    if not cfg.job:
        cfg.job = "train-gpt-%d-%d" % (os.getpid(), int(time.time() * 1000))
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "numpy"])
    q = ctx.Queue()
    t0 = time.monotonic()
    procs = [ctx.Process(target=rank_main, args=(r, cfg, socket, q),
                         name="rank%d" % r) for r in range(cfg.ranks)]
    for p in procs:
        p.start()
    if on_start is not None:
        on_start(procs)
    tokens = cfg.batch * cfg.ctx
    res = {"losses": [None] * cfg.steps, "norms": [None] * cfg.steps,
           "lrs": [None] * cfg.steps, "checkpoints": [], "start": None}
    per_step, starts, done, error = {}, {}, set(), None
    deadline = time.monotonic() + timeout
    try:
        while len(done) < cfg.ranks and error is None:
            try:
                msg = q.get(timeout=0.2)
            except queue.Empty:
                for p in procs:
                    if p.exitcode not in (None, 0):
                        error = "%s exited with %s" % (p.name, p.exitcode)
                if time.monotonic() > deadline:
                    error = "timed out after %.0fs" % timeout
                continue
            kind, r = msg[0], msg[1]
            if kind == "start":
                starts[r] = msg[2]
                res["units"] = msg[3]
                if len(starts) == cfg.ranks:
                    if len(set(starts.values())) != 1:
                        error = "ranks start at different steps: %s" % starts
                        continue
                    res["start"] = starts[0]
                    if res["start"]:
                        log("resuming at step %d (the daemon's step count)" % res["start"])
            elif kind == "step":
                s = msg[2]
                per_step.setdefault(s, {})[r] = msg[3:]
                if len(per_step[s]) == cfg.ranks:
                    got = per_step.pop(s)
                    # the global batch's loss: the mean of the ranks' slices
                    res["losses"][s] = sum(v[0] for v in got.values()) / cfg.ranks
                    res["norms"][s] = got[0][1]
                    res["lrs"][s] = got[0][2]
                    dt = max(v[3] for v in got.values())
                    log("step %4d  loss %.6f  tokens/s %8.0f  lr %.3e  grad norm %.4f"
                        % (s, res["losses"][s], tokens / max(dt, 1e-9), res["lrs"][s],
                           res["norms"][s]))
                    if on_step is not None:
                        on_step(s)
            elif kind == "checkpoint":
                res["checkpoints"].append(msg[3])
                log("checkpoint after step %d: %s" % (msg[2], msg[3]))
            elif kind == "params":
                res["params"] = msg[2]
            elif kind == "done":
                done.add(r)
            elif kind == "error":
                error = "rank %d failed: %s" % (r, msg[2])
    finally:
        if error is not None:
            for p in procs:
                if p.is_alive():
                    p.terminate()
        for p in procs:
            p.join(10)
    if error is not None:
        raise RuntimeError(error)
    res["wall_s"] = time.monotonic() - t0
    return res


def parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2, help="processes (ranks) (default 2)")
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps in all")
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences per step)")
    ap.add_argument("--accum", type=int, default=2,
                    help="backwards per step (gradient accumulation) (default 2)")
    ap.add_argument("--ctx", type=int, default=32, help="sequence length")
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--noise", type=float, default=0.1,
                    help="fraction of random tokens in the synthetic data")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    ap.add_argument("--warmup", type=int, default=5, help="warmup steps")
    ap.add_argument("--min-lr-ratio", type=float, default=0.1,
                    help="the cosine's end, as a fraction of --lr")
    ap.add_argument("--beta1", type=float, default=0.9)
    ap.add_argument("--beta2", type=float, default=0.95)
    ap.add_argument("--eps", type=float, default=1e-8)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0, help="max gradient norm (inf: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bf16", action="store_true",
                    help="bf16 parameters with the daemon's fp32 master (mixed precision)")
    ap.add_argument("--job", default=None,
                    help="job name (default: unique); relaunch an interrupted run with "
                         "the same one to resume it (a run that finished is gone)")
    ap.add_argument("--checkpoint-every", type=int, default=0, metavar="K",
                    help="daemon checkpoint every K steps into --checkpoint-dir")
    ap.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                    help="checkpoints go to DIR/step-NNNNNN (below the daemon's "
                         "--checkpoint-root; --start-daemon makes DIR the root)")
    ap.add_argument("--restore", default=None, metavar="DIR",
                    help="restore the job from checkpoint DIR first, then continue it")
    ap.add_argument("--socket", default=None, help="daemon socket (default $SHARDD_SOCKET)")
    ap.add_argument("--start-daemon", action="store_true",
                    help="start build/shardd ($SHARDD_BIN) on a temporary socket")
    ap.add_argument("--shardd", default=None, metavar="PATH",
                    help="with --start-daemon: the daemon binary (default $SHARDD_BIN, "
                         "else build/shardd)")
    ap.add_argument("--daemon-log", default=None, help="with --start-daemon: log file")
    ap.add_argument("--backend", choices=["host", "cuda", "auto"], default="host",
                    help="with --start-daemon: the daemon's backend")
    ap.add_argument("--check", action="store_true",
                    help="also train in one process with torch.optim.AdamW and compare")
    ap.add_argument("--out", default=None, help="save losses and final parameters (.npz)")
    ap.add_argument("--step-delay", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=600.0)
    return ap


def main(argv=None):
    cfg = parser().parse_args(argv)
    import importlib.util
    if importlib.util.find_spec("torch") is None:
        sys.stderr.write("train_gpt: torch is not importable by %s; run it with a Python that "
                         "has torch (Debian: apt install python3-torch, /usr/bin/python3)\n"
                         % sys.executable)
        return 2
    try:
        check_cfg(cfg)
    except ValueError as e:
        sys.stderr.write("train_gpt: %s\n" % e)
        return 2
    shardd = import_shardd()
    daemon = None
    socket = cfg.socket
    if cfg.start_daemon:
        extra = ["--collective-timeout", "60"]
        root = cfg.checkpoint_dir or (os.path.dirname(os.path.abspath(cfg.restore))
                                      if cfg.restore else None)
        if root:
            os.makedirs(root, exist_ok=True)
            extra += ["--checkpoint-root", root]
        daemon = shardd.daemon.Daemon(binary=cfg.shardd, log=cfg.daemon_log,
                                      devices=cfg.ranks if cfg.backend == "host" else None,
                                      backend=cfg.backend, extra_args=extra)
        socket = daemon.socket
        print("started %s on %s (pid %d)" % (daemon.binary, socket, daemon.proc.pid))
    try:
        if cfg.restore:
            ctl = shardd.Client(socket)
            try:
                cfg.job = ctl.restore(os.path.abspath(cfg.restore))
            finally:
                ctl.close()
            print("restored job %s from %s" % (cfg.job, cfg.restore))
        print("training: %d ranks, %d steps, global batch %d x %d tokens (%d per rank, "
              "%d backwards per step), GPT %d layers dim %d heads %d vocab %d (tied), "
              "AdamW lr=%g wd=%g, warmup %d + cosine, clip %g%s"
              % (cfg.ranks, cfg.steps, cfg.batch, cfg.ctx, cfg.batch // cfg.ranks, cfg.accum,
                 cfg.layers, cfg.dim, cfg.heads, cfg.vocab, cfg.lr, cfg.weight_decay,
                 cfg.warmup, cfg.clip, ", bf16 with an fp32 master" if cfg.bf16 else ""))
        res = run(cfg, socket, timeout=cfg.timeout)
        done = [v for v in res["losses"] if v is not None]
        nparams = sum(v.size for v in res["params"].values())
        print("units: " + ", ".join("%s (%d)" % u for u in res["units"]))
        print("done: job %s, steps %d..%d, %d parameters, loss %.6f -> %.6f, wall %.2fs"
              % (cfg.job, res["start"], cfg.steps - 1, nparams, done[0] if done else math.nan,
                 done[-1] if done else math.nan, res["wall_s"]))
        if cfg.check:
            ref_losses = reference_train(cfg)[0]
            worst = max(abs(a - b) / abs(b) for a, b in zip(res["losses"], ref_losses)
                        if a is not None)
            print("check vs torch.optim.AdamW (1 process, global batch%s): max relative "
                  "loss difference %.3g" % (", fp32 master" if cfg.bf16 else "", worst))
        if cfg.out:
            import numpy as np
            nan = lambda k: np.array([math.nan if v is None else v for v in res[k]])  # noqa: E731
            np.savez(cfg.out, start=res["start"], losses=nan("losses"), norms=nan("norms"),
                     lrs=nan("lrs"),
                     **{"param/" + k: v for k, v in res["params"].items()})
            print("saved %s" % cfg.out)
    finally:
        if daemon is not None:
            rc = daemon.stop()
            if rc not in (0, None):
                print("shardd exited with %s; log: %s" % (rc, daemon.log))
            daemon.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
