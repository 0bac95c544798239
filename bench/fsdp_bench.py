#!/usr/bin/python3
"""Step time of shardd.nn's hooked loop (transient areas: a gather, a
reduce-scatter and releases per unit, the next unit's gather prefetched
while one computes) against today's gather-everything loop (resident
areas: every unit gathered before the forward, all scattered after the
backward), same model, ranks, data and optimizer, in one run: the ratio is
what FSDP-grade memory costs in time here. The hooked loop three ways:
never prefetching, always (the issue's targets: each within 1.25x of
gather-everything), and prefetch="auto" (the default: no prefetch and no
trial where the node has no spare CPU, as 2 ranks of 1 thread on 2 CPUs;
else up to 3 steps with and 3 without, then prefetching only if more than
5% faster; timed after its choice, which is reported); and with backward prefetch (FSDP's
BACKWARD_PRE: the gather of the unit whose backward comes next sent when
a unit's backward begins), alone and beside forward prefetch. Beside
each wall-clock step, its CPU time (every rank's and the daemon's): on a machine whose CPUs are all busy (a shared one) a
step takes about its CPU time over the CPUs, whatever else runs.

Writes bench/results/fsdp.json (BENCH_RESULTS overrides the folder).
Usage: bench/fsdp_bench.py [--ranks W] [--units U] [--width N] [--steps S] [--repeat R]
"""
import argparse
import json
import multiprocessing as mp
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "client", "python"))
from procstat import Sampler  # noqa: E402

# (prefetch, backward_prefetch) of each loop
MODES = {"gather-everything": (False, False), "hooked": (False, False),
         "hooked+auto": ("auto", "auto"), "hooked+prefetch": (True, False),
         "hooked+bwd-prefetch": (False, True), "hooked+prefetch+bwd": (True, True)}


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
    sm = shardd.nn.ShardedModule(client, m, auto_wrap="children", prefetch=MODES[mode][0],
                                 backward_prefetch=MODES[mode][1])
    opt = shardd.optim.AdamW(m.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=g)
    y = torch.randn(args.batch, args.width, generator=g)
    times = []
    # 2 warm-up steps; prefetch="auto" also its trial (the first step, 3
    # with and 3 without prefetch), so that the timed steps are its choice's
    warm = 2 if MODES[mode][0] != "auto" else 2 + 2 * shardd.nn.ShardedModule._TRIAL_STEPS
    for s in range(args.steps + warm):
        if s == warm:
            t_first, c_first = time.monotonic(), time.process_time()
        t0 = time.perf_counter()
        opt.zero_grad()
        if not transient:
            sm.gather()
        loss = nn.functional.mse_loss(m(x), y)
        loss.backward()
        if not transient:
            sm.scatter("mean")
        opt.step()
        if s >= warm:
            times.append(time.perf_counter() - t0)
    t_last, cpu = time.monotonic(), time.process_time() - c_first
    client.close()
    q.put((rank, times, sm.prefetches, sm.prefetch, t_first, t_last, cpu,
           sm.backward_prefetches, (sm.prefetch_trial or {}).get("spare_cpu")))


def run(sock, daemon_pid, mode, args):
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch"])
    q = ctx.Queue()
    job = "fsdp-bench-%d-%s" % (os.getpid(), mode)
    procs = [ctx.Process(target=rank_main, args=(r, args.ranks, sock, job, mode, args, q))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    smp = Sampler([], daemon_pid, period=0.01)
    smp.start()
    got = [q.get(timeout=300) for _ in procs]
    smp.stop()
    for p in procs:
        p.join(30)
    # a step ends for all ranks together: the slowest rank's median
    per_rank = [sorted(m[1])[len(m[1]) // 2] for m in got]
    t0, t1 = max(m[4] for m in got), min(m[5] for m in got)
    cpu = (sum(m[6] for m in got) + smp.daemon_cpu(t0, t1)) / args.steps
    return {"step_ms": max(per_rank) * 1e3, "cpu_ms": cpu * 1e3,
            "prefetches": max(m[2] for m in got), "prefetch": any(m[3] for m in got),
            "backward_prefetches": max(m[7] for m in got),
            # auto's trial ran (a spare CPU), None: no trial asked for
            "spare_cpu": any(m[8] for m in got) if got[0][8] is not None else None}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--units", type=int, default=16)
    ap.add_argument("--width", type=int, default=512)  # 1 MiB fp32 per unit
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--shardd", default=os.environ.get("SHARDD_BIN", "build/shardd"))
    args = ap.parse_args()
    import shardd.daemon
    d = shardd.daemon.Daemon(binary=args.shardd, devices=args.ranks)
    try:
        # every loop --repeat times, interleaved; each figure the median
        runs = {m: [] for m in MODES}
        for _ in range(args.repeat):
            for mode in MODES:
                runs[mode].append(run(d.socket, d.proc.pid, mode, args))
    finally:
        d.stop()
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    rows = {m: {"step_ms": med([x["step_ms"] for x in runs[m]]),
                "cpu_ms": med([x["cpu_ms"] for x in runs[m]]),
                "prefetches": runs[m][0]["prefetches"],
                "backward_prefetches": runs[m][0]["backward_prefetches"],
                # the choice in each run (auto's may differ between runs)
                "prefetch": sum(x["prefetch"] for x in runs[m]) * 2 > len(runs[m]),
                "prefetch_runs": [x["prefetch"] for x in runs[m]],
                "spare_cpu_runs": [x["spare_cpu"] for x in runs[m]]}
            for m in MODES}
    base = rows["gather-everything"]
    for r in rows.values():
        r["vs_gather_everything"] = r["step_ms"] / base["step_ms"]
        r["cpu_vs_gather_everything"] = r["cpu_ms"] / base["cpu_ms"]
    try:
        cpus = len(os.sched_getaffinity(0))
    except OSError:
        cpus = os.cpu_count()
    print("\nshardd.nn step time, %d ranks on %d CPUs, %d units of %d x %d fp32, AdamW "
          "(median of %d steps%s); prefetch auto chose it in %d of %d runs%s"
          % (args.ranks, cpus, args.units, args.width, args.width, args.steps,
             ", %d runs" % args.repeat if args.repeat > 1 else "",
             sum(rows["hooked+auto"]["prefetch_runs"]), args.repeat,
             " (no spare CPU: no trial)" if False in rows["hooked+auto"]["spare_cpu_runs"]
             else ""))
    print("%-20s %10s %12s %9s %12s %11s %11s" % (
        "loop", "step ms", "vs gather-all", "CPU ms", "vs gather-all", "prefetches",
        "backward"))
    for mode, r in rows.items():
        print("%-20s %10.2f %11.2fx %9.2f %11.2fx %11d %11d" % (
            mode, r["step_ms"], r["vs_gather_everything"], r["cpu_ms"],
            r["cpu_vs_gather_everything"], r["prefetches"], r["backward_prefetches"]))
    out = os.path.join(os.environ.get("BENCH_RESULTS", "bench/results"), "fsdp.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"ranks": args.ranks, "cpus": cpus, "units": args.units,
                   "width": args.width, "steps": args.steps, "repeat": args.repeat,
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
