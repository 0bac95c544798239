#!/usr/bin/env python3
"""Train a small MLP with AdamW through shardd, one process per rank.

    make && python3 examples/train_mlp.py --ranks 4 --steps 50 --start-daemon

Every rank is a process (multiprocessing, forkserver) with its own shardd
connection. The model is wrapped by shardd.nn.ShardedModule: one flat buffer
per top-level child (FSDP auto-wrap), each original parameter registered as a
view and replaced by a view of the gather area (use_orig_params). Per step,
every rank:

    gather (all flat buffers) -> forward on its slice of the global batch
    -> backward (grads land in the grad areas) -> scatter(mean) -> step

so with mean reduction and equal slices the N-rank run computes the same
updates as one process on the full batch (--check compares against a plain
torch.optim.AdamW run and prints the max relative difference).

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


# ---- model, data and the plain-torch reference ------------------------------

def make_model(cfg):
    import torch
    from torch import nn
    torch.manual_seed(cfg.seed)
    return nn.Sequential(
        nn.Linear(cfg.dim_in, cfg.hidden), nn.Tanh(),
        nn.Linear(cfg.hidden, cfg.hidden), nn.Tanh(),
        nn.Linear(cfg.hidden, cfg.dim_out),
    )


def make_data(cfg):
    """(X, Y): X[step] is the global batch of that step, (batch, dim_in)."""
    import torch
    g = torch.Generator().manual_seed(cfg.seed + 1)
    w_true = torch.randn(cfg.dim_in, cfg.dim_out, generator=g) / math.sqrt(cfg.dim_in)
    x = torch.randn(cfg.steps, cfg.batch, cfg.dim_in, generator=g)
    y = torch.tanh(x @ w_true) + 0.05 * torch.randn(cfg.steps, cfg.batch, cfg.dim_out, generator=g)
    return x, y


def adamw_hyper(cfg):
    return dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                weight_decay=cfg.weight_decay)


def reference_train(cfg):
    """One process, full batch, torch.optim.AdamW. -> (params, losses)."""
    import torch
    torch.set_num_threads(1)
    model = make_model(cfg)
    x, y = make_data(cfg)
    opt = torch.optim.AdamW(model.parameters(), foreach=False, **adamw_hyper(cfg))
    losses = []
    for s in range(cfg.steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[s]), y[s])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    params = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    return params, losses


# ---- one rank ------------------------------------------------------------------

def rank_main(rank, cfg, socket, q):
    try:
        import torch
        torch.set_num_threads(1)
        shardd = import_shardd()
        import shardd.nn
        t0 = time.monotonic()
        # resident areas (SHARD_GRAD_OP): this loop gathers and scatters itself
        client = shardd.Client(socket, job=cfg.job, rank=rank, world=cfg.ranks,
                               reshard_after_forward=False,
                               client_name="train_mlp rank %d" % rank)
        model = make_model(cfg)
        x, y = make_data(cfg)
        per = cfg.batch // cfg.ranks
        lo, hi = rank * per, (rank + 1) * per
        sm = shardd.nn.ShardedModule(client, model, auto_wrap=cfg.auto_wrap)
        opt = sm.register_optimizer("adamw", model.parameters(), name="adamw",
                                    **adamw_hyper(cfg))
        t1 = time.monotonic()
        # cpu on the host backend; the rank's GPU on the cuda backend
        dev = sm.device
        for s in range(cfg.steps):
            sm.gather()
            loss = torch.nn.functional.mse_loss(model(x[s, lo:hi].to(dev)),
                                                y[s, lo:hi].to(dev))
            sm.zero_grad()
            loss.backward()
            sm.scatter("mean")
            res = sm.step(opt)
            if res.step != s + 1:
                raise RuntimeError("daemon step count %d, expected %d" % (res.step, s + 1))
            q.put(("loss", rank, s, loss.item()))
        sm.gather()
        t2 = time.monotonic()
        if rank == 0:
            params = {n: p.detach().cpu().numpy().copy()
                      for n, p in model.named_parameters()}
            units = [(u.name, u.buffer.numel, u.buffer.padded_numel) for u in sm.units]
            q.put(("params", rank, params, units))
        client.close()
        q.put(("done", rank, t1 - t0, t2 - t1))
    except BaseException as e:  # report, then fail the process
        import traceback
        q.put(("error", rank, "%s\n%s" % (e, traceback.format_exc())))
        raise SystemExit(1)


# ---- driver --------------------------------------------------------------------

def run(cfg, socket, log=print, timeout=600.0):
    """Spawns cfg.ranks rank processes against the daemon at socket.
    -> dict(params, losses (global mean per step), units, setup_s, train_s, wall_s)."""
    if cfg.batch % cfg.ranks:
        raise ValueError("--batch %d is not a multiple of --ranks %d" % (cfg.batch, cfg.ranks))
    if not cfg.job:
        cfg.job = "train-mlp-%d-%d" % (os.getpid(), int(time.time() * 1000))
    # forkserver: one clean server process imports torch once and forks the
    # ranks (no torch threads exist there yet, unlike in a parent that may
    # have trained already), saving a torch import per rank.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "numpy"])
    q = ctx.Queue()
    t0 = time.monotonic()
    procs = [ctx.Process(target=rank_main, args=(r, cfg, socket, q), name="rank%d" % r)
             for r in range(cfg.ranks)]
    for p in procs:
        p.start()
    per_step = {}
    losses = [None] * cfg.steps
    result = {}
    done = {}
    error = None
    deadline = time.monotonic() + timeout
    try:
        while len(done) < cfg.ranks and error is None:
            try:
                msg = q.get(timeout=0.5)
            except queue.Empty:
                for p in procs:
                    if p.exitcode not in (None, 0):
                        error = "%s exited with %s" % (p.name, p.exitcode)
                if time.monotonic() > deadline:
                    error = "timed out after %.0fs" % timeout
                continue
            kind = msg[0]
            if kind == "loss":
                _, r, s, v = msg
                per_step.setdefault(s, {})[r] = v
                if len(per_step[s]) == cfg.ranks:
                    losses[s] = sum(per_step.pop(s).values()) / cfg.ranks
                    if s % cfg.log_every == 0 or s == cfg.steps - 1:
                        log("step %4d  loss %.6f" % (s, losses[s]))
            elif kind == "params":
                result["params"], result["units"] = msg[2], msg[3]
            elif kind == "done":
                done[msg[1]] = (msg[2], msg[3])
            elif kind == "error":
                error = "rank %d failed: %s" % (msg[1], msg[2])
    finally:
        if error is not None:
            for p in procs:
                if p.is_alive():
                    p.terminate()
        for p in procs:
            p.join(10)
    if error is not None:
        raise RuntimeError(error)
    result["losses"] = losses
    result["setup_s"] = max(d[0] for d in done.values())
    result["train_s"] = max(d[1] for d in done.values())
    result["wall_s"] = time.monotonic() - t0
    return result


def max_rel_diff(a, b):
    """-> (max over parameter tensors of max|a-b| / max|b|, max over elements
    with |b| >= 1e-2 of |a-b| / |b|)."""
    import numpy as np
    tw = ew = 0.0
    for n in b:
        x, y = a[n].astype(np.float64), b[n].astype(np.float64)
        d = np.abs(x - y)
        tw = max(tw, float(d.max() / max(np.abs(y).max(), 1e-30)))
        big = np.abs(y) >= 1e-2
        if big.any():
            ew = max(ew, float((d[big] / np.abs(y[big])).max()))
    return tw, ew


def parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4, help="processes (ranks) (default 4)")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch", type=int, default=64, help="global batch size")
    ap.add_argument("--dim-in", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--dim-out", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--beta1", type=float, default=0.9)
    ap.add_argument("--beta2", type=float, default=0.999)
    ap.add_argument("--eps", type=float, default=1e-8)
    ap.add_argument("--weight-decay", type=float, default=1e-2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--auto-wrap", choices=["children", "module"], default="children",
                    help="one flat buffer per top-level child (default) or per module")
    ap.add_argument("--job", default=None, help="job name (default: unique)")
    ap.add_argument("--socket", default=None, help="daemon socket (default $SHARDD_SOCKET)")
    ap.add_argument("--start-daemon", action="store_true",
                    help="start build/shardd ($SHARDD_BIN) on a temporary socket")
    ap.add_argument("--shardd", default=None, metavar="PATH",
                    help="with --start-daemon: the daemon binary (default $SHARDD_BIN, "
                         "else build/shardd)")
    ap.add_argument("--daemon-log", default=None, help="with --start-daemon: log file")
    ap.add_argument("--backend", choices=["host", "cuda", "auto"], default="host",
                    help="with --start-daemon: the daemon's backend (cuda: every visible "
                         "GPU, ranks round-robin over them)")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--check", action="store_true",
                    help="also train with plain torch.optim.AdamW and compare")
    ap.add_argument("--out", default=None, help="save final parameters and losses (.npz)")
    ap.add_argument("--timeout", type=float, default=600.0)
    return ap


def main(argv=None):
    cfg = parser().parse_args(argv)
    import importlib.util
    if importlib.util.find_spec("torch") is None:
        sys.stderr.write("train_mlp: torch is not importable by %s; run it with a Python that "
                         "has torch (Debian: apt install python3-torch, /usr/bin/python3)\n"
                         % sys.executable)
        return 2
    shardd = import_shardd()
    daemon = None
    socket = cfg.socket
    if cfg.start_daemon:
        daemon = shardd.daemon.Daemon(binary=cfg.shardd, log=cfg.daemon_log,
                                      devices=cfg.ranks if cfg.backend == "host" else None,
                                      backend=cfg.backend,
                                      extra_args=["--collective-timeout", "60"])
        socket = daemon.socket
        print("started %s on %s (pid %d)" % (daemon.binary, socket, daemon.proc.pid))
    try:
        print("training: %d ranks, %d steps, global batch %d (%d per rank), MLP %d-%d-%d-%d, "
              "AdamW lr=%g wd=%g" % (cfg.ranks, cfg.steps, cfg.batch, cfg.batch // max(cfg.ranks, 1),
                                     cfg.dim_in, cfg.hidden, cfg.hidden, cfg.dim_out, cfg.lr,
                                     cfg.weight_decay))
        res = run(cfg, socket, timeout=cfg.timeout)
        nparams = sum(v.size for v in res["params"].values())
        print("flat buffers: " + ", ".join("%s (%d elements, padded %d)" % u for u in res["units"]))
        print("done: %d ranks x %d steps, %d parameters, final loss %.6f (first %.6f); "
              "setup %.2fs, train %.2fs (%.1f ms/step), wall %.2fs"
              % (cfg.ranks, cfg.steps, nparams, res["losses"][-1], res["losses"][0],
                 res["setup_s"], res["train_s"], 1e3 * res["train_s"] / max(cfg.steps, 1),
                 res["wall_s"]))
        if cfg.check:
            ref, ref_losses = reference_train(cfg)
            tw, ew = max_rel_diff(res["params"], ref)
            print("check vs torch.optim.AdamW (1 process, full batch): max relative difference "
                  "%.3g (per tensor), %.3g (per element, |ref| >= 1e-2); final loss %.6f vs %.6f"
                  % (tw, ew, res["losses"][-1], ref_losses[-1]))
        if cfg.out:
            import numpy as np
            np.savez(cfg.out, losses=np.array(res["losses"]),
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
