#!/usr/bin/python3
"""Memory of shardd.nn on the model shapes people train, against FSDP's
bound and a DDP replica: the nanoGPT-shaped GPT wrapped per Block, a
LLaMA-shaped model per decoder layer in bf16 with its fp32 master, and a
ResNet-18-shaped CNN per BasicBlock (tests/python/models.py), at 2 and 4
ranks, each on a daemon of its own (host backend, a device per rank), a
default Client (transient areas) and AdamW in the daemon, for a few steps.

Per row: the daemon's peak bytes over every device (exact), its bytes
after the first step (a 16-bit unit's exact initial values are held until
then), the bound -- fp32: 16*P + 4*(R + M)*(W + 1); bf16 with an fp32
master: 18*P + 2*(R + M)*(W + 1): the pool slots the hooked loop holds at
once, the root unit (R parameters) and the largest other (M), gathered
once per node, read by every local rank, and as gradient areas per rank
(see tests/python/test_memory_bound.py; the pools' worst case, what the
job reserves, 16*P + 4*U*(3*W + 1), and FSDP's, a gathered copy per
rank: 16*P + 16*U*W and 18*P + 8*U*W, beside it) -- and what the
daemon lays out for it (4 KiB pages per region, 19 more after an area of
1 MiB or more), the trainer's private memory (RssAnon growth of a rank from
before building the model to after the steps), and per rank shardd's total
(daemon peak / W + that growth) against a DDP replica's 16*P per rank
(parameters, gradients, Adam's two moments; activations left out of both).

Writes bench/results/model_memory.json (BENCH_RESULTS overrides the folder).
Usage: bench/model_memory_bench.py [--ranks 2,4] [--steps S]
"""
import argparse
import json
import multiprocessing as mp
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for p in (os.path.join(REPO, "client", "python"), os.path.join(REPO, "tests", "python")):
    sys.path.insert(0, p)
from procstat import trimmed_rss  # noqa: E402  (the benches' one /proc reader)

ROWS = 2  # rows per rank per step: memory is the point, not compute


def cases():
    """name -> (build, auto_wrap, dtype, batch(rank, world), loss)."""
    from torch import nn
    import models
    gpt = models.GPTConfig(vocab=2048, ctx=32, dim=256, heads=8, layers=4)
    llama = models.LlamaConfig(vocab=2048, ctx=32, dim=256, heads=8, layers=4)

    def lm_loss(m, x, y):
        logits = m(x).float()
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    return {
        "GPT (nanoGPT, per Block)": (
            lambda: models.nano_gpt(gpt), {models.Block}, "fp32",
            lambda r, w: models.gpt_batch(gpt, 0, r, w, ROWS), lm_loss),
        "LLaMA bf16 (per decoder layer)": (
            lambda: models.llama(llama), {models.LlamaDecoderLayer}, "bf16",
            lambda r, w: models.gpt_batch(llama, 0, r, w, ROWS), lm_loss),
        "ResNet-18 (per BasicBlock)": (
            lambda: models.resnet(64), {models.BasicBlock}, "fp32",
            lambda r, w: models.image_batch(0, r, w, ROWS),
            lambda m, x, y: nn.functional.cross_entropy(m(x), y)),
    }


def device_bytes(client):
    st = client.status()
    return (sum(d["peak_bytes"] for d in st["devices"]),
            sum(d["used_bytes"] for d in st["devices"]))


def rank_main(rank, world, sock, name, steps, q):
    try:
        import torch
        import shardd
        import shardd.nn
        import shardd.optim
        torch.set_num_threads(1)
        build, auto_wrap, dtype, batch, loss_of = cases()[name]
        client = shardd.Client(sock, job="model-memory-bench", rank=rank,
                               world=world)
        base = trimmed_rss()
        model = build()
        sm = shardd.nn.ShardedModule(client, model, auto_wrap=auto_wrap,
                                     dtype=None if dtype == "fp32" else dtype)
        opt = shardd.optim.AdamW(model.parameters(), lr=1e-3)
        x, y = batch(rank, world)
        after_first = None
        for s in range(steps):
            opt.zero_grad()
            loss_of(model, x, y).backward()
            opt.step()
            if s == 0:
                after_first = device_bytes(client)[1]
        peak = device_bytes(client)[0]
        grown = trimmed_rss() - base
        q.put((rank, grown, peak, after_first, [(u.name, u.buffer.numel) for u in sm.units]))
        client.close()
    except BaseException as e:
        import traceback
        q.put((rank, "error", "%s\n%s" % (e, traceback.format_exc())))


def run(binary, name, world, steps):
    import shardd.daemon
    d = shardd.daemon.Daemon(binary=binary, devices=world)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch"])
    q = ctx.Queue()
    try:
        procs = [ctx.Process(target=rank_main, args=(r, world, d.socket, name, steps, q))
                 for r in range(world)]
        for p in procs:
            p.start()
        got = [q.get(timeout=600) for _ in procs]
        for p in procs:
            p.join(30)
    finally:
        d.stop()
    bad = [g for g in got if g[1] == "error"]
    if bad:
        raise RuntimeError("%s, %d ranks, rank %d: %s" % (name, world, bad[0][0], bad[0][2]))
    # every rank read the devices after the last step (a collective): the
    # last one saw the whole peak
    return (max(g[1] for g in got), max(g[2] for g in got), max(g[3] for g in got), got[0][4])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--shardd", default=os.environ.get("SHARDD_BIN", "build/shardd"))
    args = ap.parse_args()
    from test_memory_bound import daemon_bytes, fsdp_bound, bf16_bound, node_bound, worst_bound
    rows = []
    for name, (build, _, dtype, _, _) in cases().items():
        for world in (int(w) for w in args.ranks.split(",")):
            grown, peak, after_first, units = run(args.shardd, name, world, args.steps)
            numels = [n for _, n in units]
            P, U = sum(numels), max(numels)
            bound = node_bound(units, world, dtype)
            fsdp = (fsdp_bound if dtype == "fp32" else bf16_bound)(numels, world)
            rows.append({
                "model": name, "dtype": dtype, "world": world, "params": P,
                "largest_unit": U, "units": len(numels),
                "peak_bytes": peak, "after_first_step_bytes": after_first,
                "bound_bytes": bound, "paged_bound_bytes": daemon_bytes(units, world, dtype),
                "worst_bound_bytes": worst_bound(units, world, dtype),
                "fsdp_bound_bytes": fsdp,
                "rank_private_growth_bytes": grown,
                "model_fp32_bytes": 4 * P, "ddp_per_rank_bytes": 16 * P,
                "per_rank_bytes": peak / world + grown,
            })
    print("\nshardd.nn memory on model shapes, AdamW, default Client (transient areas); "
          "MiB; bound: fp32 16*P + 4*(R + M)*(W + 1), bf16 18*P + 2*(R + M)*(W + 1) (the "
          "slots the loop holds at once: the root unit R and the largest other M, gathered "
          "once per node and a gradient area a rank); FSDP's: fp32 16*P + 16*U*W, "
          "bf16 18*P + 8*U*W")
    print("%-31s %2s %6s %6s %8s %8s %8s %6s %6s %6s %8s %7s %8s"
          % ("model", "W", "P (M)", "U (M)", "peak", "step 1", "bound", "peak/", "step1/",
             "peak/", "private", "/ rank", "vs DDP"))
    print("%-31s %2s %6s %6s %8s %8s %8s %6s %6s %6s %8s %7s %8s"
          % ("", "", "", "", "", "", "", "bound", "bound", "FSDP", "per rank", "total",
             "16*P"))
    mib = 2.0 ** 20
    for x in rows:
        x["peak_over_bound"] = x["peak_bytes"] / x["bound_bytes"]
        x["after_first_over_bound"] = x["after_first_step_bytes"] / x["bound_bytes"]
        x["peak_over_paged_bound"] = x["peak_bytes"] / x["paged_bound_bytes"]
        x["peak_over_fsdp_bound"] = x["peak_bytes"] / x["fsdp_bound_bytes"]
        x["per_rank_over_ddp"] = x["per_rank_bytes"] / x["ddp_per_rank_bytes"]
        x["private_over_model"] = x["rank_private_growth_bytes"] / x["model_fp32_bytes"]
        print("%-31s %2d %6.2f %6.2f %8.1f %8.1f %8.1f %5.3fx %5.3fx %5.3fx %8.2f %7.1f %7.2fx"
              % (x["model"], x["world"], x["params"] / 1e6, x["largest_unit"] / 1e6,
                 x["peak_bytes"] / mib, x["after_first_step_bytes"] / mib,
                 x["bound_bytes"] / mib, x["peak_over_bound"], x["after_first_over_bound"],
                 x["peak_over_fsdp_bound"],
                 x["rank_private_growth_bytes"] / mib, x["per_rank_bytes"] / mib,
                 x["per_rank_over_ddp"]))
    out = os.path.join(os.environ.get("BENCH_RESULTS", "bench/results"), "model_memory.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"steps": args.steps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
