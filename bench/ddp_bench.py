#!/usr/bin/python3
"""End to end against what a CPU user runs instead: shardd.nn's hooked loop
(transient areas, each GPT Block a unit, the daemon's AdamW; forward
prefetch on and off: prefetch="auto", the default, keeps prefetching
after a trial of 6 steps only where it was more than 5% faster, and
bench/summary.py judges the loop so chosen) against torch DistributedDataParallel (gloo) with
torch's AdamW, and DDP with ZeroRedundancyOptimizer (AdamW's state
sharded over the ranks): the same nanoGPT-shaped GPT
(tests/python/models.py) at two sizes, 2 and 4 ranks, the same per-rank
batch, one thread per rank, every loop in one run.

Step time: the median over the timed steps of the slowest rank (a step
ends for every rank together). Memory per rank: while the timed steps run,
this process samples every rank's private resident memory (RssAnon): the
peak of their sum, less their sum before the model was built; for shardd
plus the daemon's peak (its shards, optimizer state and the areas the
ranks map, counted there once; a rank's mappings of them are RssShmem,
not added): the larger of its devices' peak bytes (its status) and its
resident growth (RssAnon + RssShmem, sampled); all divided by the ranks.

The target for memory is the sharded bound's ratio at the measured size:
(16*P/W + A) / (16*P + A) bytes, fp32 AdamW (parameter, gradient, two
moments: 16 B a parameter; DDP holds all of it on every rank, a sharded
loop, 1/W of it), A the activations, measured in the DDP run as its peak
less what it holds after a step once the heap gave back its free pages.
Beside it FSDP's own bound, which adds the gathered unit and its gradient
area that every rank holds at a time (fp32: 16*U bytes a rank, U the
largest unit's parameters, with 2 leases of each): (16*P/W + 16*U + A) /
(16*P + A).

Writes bench/results/ddp.json (BENCH_RESULTS overrides the folder).
Usage: bench/ddp_bench.py [--ranks 2,4] [--sizes small,large] [--steps S]
"""
import argparse
import json
import multiprocessing as mp
import os
import queue
import socket
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "client", "python"))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
from procstat import Sampler, rss, trimmed_rss  # noqa: E402

# nanoGPT's shape at two sizes small enough for a few minutes on two CPUs
# with this machine's generic BLAS; ctx*rows tokens per rank per step
SIZES = {
    "small": dict(vocab=2048, ctx=32, dim=128, heads=4, layers=4),
    "large": dict(vocab=4096, ctx=32, dim=256, heads=8, layers=4),
}
MODES = ("ddp", "ddp+zero", "shardd", "shardd+prefetch")
WARMUP = 2


def rank_main(rank, world, mode, size, args, where, q):
    try:
        import torch
        import models
        torch.set_num_threads(1)
        cfg = models.GPTConfig(seed=0, **SIZES[size])
        if mode.startswith("ddp"):
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel
            from torch.distributed.optim import ZeroRedundancyOptimizer
            os.environ["MASTER_ADDR"] = "127.0.0.1"
            os.environ["MASTER_PORT"] = str(where)
            dist.init_process_group("gloo", rank=rank, world_size=world)
            base = trimmed_rss()
            model = models.nano_gpt(cfg)
            net = DistributedDataParallel(model)
            if mode == "ddp+zero":
                opt = ZeroRedundancyOptimizer(model.parameters(),
                                              optimizer_class=torch.optim.AdamW, lr=1e-3)
            else:
                opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        else:
            import shardd
            import shardd.nn
            import shardd.optim
            client = shardd.Client(where, job="ddp-bench-%d-%s-%s-%d" % (
                os.getppid(), mode, size, world), rank=rank, world=world,
                transient_areas=True)
            base = trimmed_rss()
            model = models.nano_gpt(cfg)
            sm = shardd.nn.ShardedModule(client, model, auto_wrap={models.Block},
                                         prefetch=mode == "shardd+prefetch")
            net = model
            opt = shardd.optim.AdamW(model.parameters(), lr=1e-3)
        params = sum(p.numel() for p in models.nano_gpt(cfg).parameters())
        times, t_first = [], None
        for s in range(WARMUP + args.steps):
            x, y = models.gpt_batch(cfg, s, rank, world, rows=args.rows)
            if s == WARMUP:
                t_first, c_first = time.monotonic(), time.process_time()
            t0 = time.perf_counter()
            opt.zero_grad()
            models.gpt_loss(net, x, y).backward()
            opt.step()
            if s >= WARMUP:
                times.append(time.perf_counter() - t0)
        t_last, cpu = time.monotonic(), time.process_time() - c_first
        steady = trimmed_rss() - base
        pre, dpeak = 0, 0
        if not mode.startswith("ddp"):
            # the daemon's own count of its devices' peak bytes, beside the
            # resident memory sampled (every rank has finished its steps
            # once its own last step, a collective, returned)
            pre = sm.prefetches
            dpeak = sum(x["peak_bytes"] for x in client.status()["devices"])
        unit = max(u.buffer.numel for u in sm.units) if not mode.startswith("ddp") else 0
        q.put(("rank", rank, base, times, t_first, t_last, steady, params, cpu, pre, dpeak,
               unit))
        if mode.startswith("ddp"):
            import torch.distributed as dist
            dist.barrier()
            dist.destroy_process_group()
        else:
            client.close()
    except BaseException as e:
        import traceback
        q.put(("error", rank, "%s\n%s" % (e, traceback.format_exc())))
        raise SystemExit(1)


def cpus():
    """The CPUs this process may run on (the ranks and the daemon too)."""
    try:
        return len(os.sched_getaffinity(0))
    except OSError:
        return os.cpu_count()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(ctx, mode, size, world, args):
    import shardd.daemon
    d = None
    if mode.startswith("shardd"):
        # a daemon per run: its growth is this run's alone
        d = shardd.daemon.Daemon(binary=args.shardd, devices=world)
        where = d.socket
        daemon_base = rss(d.proc.pid, shmem=True)
    else:
        where, daemon_base = free_port(), 0
    q = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, world, mode, size, args, where, q))
             for r in range(world)]
    try:
        for p in procs:
            p.start()
        smp = Sampler([p.pid for p in procs], d.proc.pid if d else None)
        smp.start()
        got = []
        deadline = time.monotonic() + 600
        while len(got) < world:
            try:
                m = q.get(timeout=1)
            except queue.Empty:
                # a rank that died before it could report (an import or
                # pickling error) says so now, not after the timeout
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError("%s: rank %s exited without a result" % (
                        mode, dead) if dead else "%s: no result in 600 s" % mode)
                continue
            if m[0] == "error":
                raise RuntimeError("%s rank %d: %s" % (mode, m[1], m[2]))
            got.append(m)
        smp.stop()
        for p in procs:
            p.join(60)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        if d:
            d.stop()
    t0 = max(m[4] for m in got)
    t1 = min(m[5] for m in got)
    window = smp.window(t0, t1)
    # the ranks' private growth at its peak, and the daemon's: the larger of
    # its own count of its devices' bytes and its resident growth (which
    # adds its heap, and misses pages it never touched)
    ranks_peak = max(sum(s[1]) for s in window) - sum(m[2] for m in got)
    daemon_rss = max(s[2] for s in window) - daemon_base if d else 0
    daemon_bytes = max(max(m[10] for m in got), daemon_rss)
    peak = ranks_peak + daemon_bytes
    # a step ends for every rank together: the slowest rank's median
    step = max(sorted(m[3])[len(m[3]) // 2] for m in got)
    # CPU time per step, every rank's and the daemon's: what a step costs
    # the machine whatever else runs on it
    dcpu = smp.daemon_cpu(t0, t1) if d else 0
    cpu = (sum(m[8] for m in got) + dcpu) / args.steps
    return {"step_ms": step * 1e3, "cpu_ms": cpu * 1e3, "daemon_cpu_ms": dcpu * 1e3 / args.steps,
            "mem_per_rank": peak / world,
            "steady_per_rank": sum(m[6] for m in got) / world, "samples": len(window),
            "params": got[0][7], "prefetches": max(m[9] for m in got),
            "daemon_peak_bytes": max(m[10] for m in got), "daemon_rss_peak": daemon_rss,
            "ranks_private_peak": ranks_peak, "largest_unit": max(m[11] for m in got)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--sizes", default="small,large")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of every loop, interleaved; each figure the median")
    ap.add_argument("--shardd", default=os.environ.get("SHARDD_BIN", "build/shardd"))
    args = ap.parse_args()
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch"])
    rows = []
    for size in args.sizes.split(","):
        for world in (int(w) for w in args.ranks.split(",")):
            runs = {m: [] for m in MODES}
            for _ in range(args.repeat):
                for mode in MODES:
                    runs[mode].append(run(ctx, mode, size, world, args))
            med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
            r = {m: {k: med([x[k] for x in runs[m]])
                     for k in ("step_ms", "cpu_ms", "daemon_cpu_ms", "mem_per_rank",
                           "steady_per_rank",
                               "prefetches", "daemon_peak_bytes", "daemon_rss_peak",
                               "ranks_private_peak")}
                 for m in MODES}
            p = runs["ddp"][0]["params"]
            ddp = r["ddp"]
            act = max(ddp["mem_per_rank"] - ddp["steady_per_rank"], 0)
            bound = (16 * p / world + act) / (16 * p + act)
            unit = runs["shardd"][0]["largest_unit"]
            fsdp_bound = (16 * p / world + 16 * unit + act) / (16 * p + act)
            for m in MODES:
                r[m]["step_vs_ddp"] = r[m]["step_ms"] / ddp["step_ms"]
                r[m]["cpu_vs_ddp"] = r[m]["cpu_ms"] / ddp["cpu_ms"]
                r[m]["mem_vs_ddp"] = r[m]["mem_per_rank"] / ddp["mem_per_rank"]
            rows.append({"size": size, "ranks": world, "params": p, "activations": act,
                         "tokens": args.rows * SIZES[size]["ctx"], "config": SIZES[size],
                         "sharded_bound_vs_ddp": bound, "largest_unit": unit,
                         "fsdp_bound_vs_ddp": fsdp_bound, "loops": r})
            print_row(rows[-1], args)
    out = os.path.join(os.environ.get("BENCH_RESULTS", "bench/results"), "ddp.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"steps": args.steps, "repeat": args.repeat, "cpus": cpus(), "rows": rows},
                  f, indent=1)


def print_row(row, args):
    MiB = 2.0 ** 20
    print("\nGPT %s (%.1fM parameters, dim %d, %d layers), %d ranks, %d tokens per rank, "
          "AdamW (median of %d steps%s)" % (
              row["size"], row["params"] / 1e6, row["config"]["dim"],
              row["config"]["layers"], row["ranks"], row["tokens"], args.steps,
              ", %d runs" % args.repeat if args.repeat > 1 else ""))
    print("%-16s %9s %8s %9s %8s %13s %8s %10s" % (
        "loop", "step ms", "vs DDP", "CPU ms", "vs DDP", "MiB per rank", "vs DDP",
        "prefetches"))
    for m, x in row["loops"].items():
        print("%-16s %9.1f %7.2fx %9.1f %7.2fx %13.1f %7.2fx %10d" % (
            m, x["step_ms"], x["step_vs_ddp"], x["cpu_ms"], x["cpu_vs_ddp"],
            x["mem_per_rank"] / MiB, x["mem_vs_ddp"], x["prefetches"]))
    print("sharded bound (16P/W + A)/(16P + A) = %.2fx, FSDP's (16P/W + 16U + A)/(16P + A) "
          "= %.2fx (A, DDP's activations: %.1f MiB; U %.2fM parameters)"
          % (row["sharded_bound_vs_ddp"], row["fsdp_bound_vs_ddp"], row["activations"] / MiB,
             row["largest_unit"] / 1e6))


if __name__ == "__main__":
    main()
