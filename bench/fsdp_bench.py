#!/usr/bin/python3
"""Step time of shardd.nn's hooked loop (transient areas: a gather, a
reduce-scatter and releases per unit, the next unit's gather prefetched
while one computes) against today's gather-everything loop (resident
areas: every unit gathered before the forward, all scattered after the
backward), same model, ranks, data and optimizer, in one run: the ratio is
what FSDP-grade memory costs in time here. Also the hooked loop without
prefetch, to show what prefetching hides.

Writes bench/results/fsdp.json (BENCH_RESULTS overrides the folder).
Usage: bench/fsdp_bench.py [--ranks W] [--units U] [--width N] [--steps S]
"""
import argparse
import json
import multiprocessing as mp
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "client", "python"))


def model(units, width):
    import torch
    from torch import nn
    torch.manual_seed(0)
    layers = []
    for _ in range(units):
        layers += [nn.Linear(width, width, bias=False), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def rank_main(rank, world, sock, job, mode, args, q):
    import torch
    from torch import nn
    import shardd
    import shardd.nn
    import shardd.optim
    torch.set_num_threads(1)
    transient = mode != "gather-everything"
    client = shardd.Client(sock, job=job, rank=rank, world=world, transient_areas=transient)
    m = model(args.units, args.width)
    sm = shardd.nn.ShardedModule(client, m, auto_wrap="children",
                                 prefetch=mode == "hooked+prefetch")
    opt = shardd.optim.AdamW(m.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=g)
    y = torch.randn(args.batch, args.width, generator=g)
    times = []
    for s in range(args.steps + 2):  # 2 warm-up steps
        t0 = time.perf_counter()
        opt.zero_grad()
        if not transient:
            sm.gather()
        loss = nn.functional.mse_loss(m(x), y)
        loss.backward()
        if not transient:
            sm.scatter("mean")
        opt.step()
        if s >= 2:
            times.append(time.perf_counter() - t0)
    client.close()
    q.put((rank, times, sm.prefetches))


def run(sock, mode, args):
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch"])
    q = ctx.Queue()
    job = "fsdp-bench-%d-%s" % (os.getpid(), mode)
    procs = [ctx.Process(target=rank_main, args=(r, args.ranks, sock, job, mode, args, q))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    got = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(30)
    # a step ends for all ranks together: the slowest rank's median
    per_rank = [sorted(t)[len(t) // 2] for _, t, _ in got]
    return max(per_rank), max(p for _, _, p in got)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--units", type=int, default=16)
    ap.add_argument("--width", type=int, default=512)  # 1 MiB fp32 per unit
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--shardd", default=os.environ.get("SHARDD_BIN", "build/shardd"))
    args = ap.parse_args()
    import shardd.daemon
    d = shardd.daemon.Daemon(binary=args.shardd, devices=args.ranks)
    try:
        rows = {}
        for mode in ("gather-everything", "hooked", "hooked+prefetch"):
            med, pre = run(d.socket, mode, args)
            rows[mode] = {"step_ms": med * 1e3, "prefetches": pre}
    finally:
        d.stop()
    base = rows["gather-everything"]["step_ms"]
    for r in rows.values():
        r["vs_gather_everything"] = r["step_ms"] / base
    print("\nshardd.nn step time, %d ranks, %d units of %d x %d fp32, AdamW (median of %d steps)"
          % (args.ranks, args.units, args.width, args.width, args.steps))
    print("%-20s %10s %12s %11s" % ("loop", "step ms", "vs gather-all", "prefetches"))
    for mode, r in rows.items():
        print("%-20s %10.2f %11.2fx %11d" % (mode, r["step_ms"], r["vs_gather_everything"],
                                              r["prefetches"]))
    out = os.path.join(os.environ.get("BENCH_RESULTS", "bench/results"), "fsdp.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"ranks": args.ranks, "units": args.units, "width": args.width,
                   "steps": args.steps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
