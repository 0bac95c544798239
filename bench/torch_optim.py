#!/usr/bin/python3
"""Times torch.optim.AdamW on CPU on the sizes optim_bench uses, as the peer
for the shardd AdamW kernel; prints a table and writes JSON.

Run by bench/run.sh with Debian's python3-torch (/usr/bin/python3). Variants:
foreach=False (the single-tensor loop shardd's numerics follow) and
foreach=True (the multi-tensor path). fused is not a CPU option in torch
1.13: AdamW has no `fused` argument at all, and Adam's fused=True is
CUDA-only; the script records what the installed torch says.

Usage: torch_optim.py --sizes 262144,16777216 [--reps N] [--out FILE]
"""
import argparse
import inspect
import json
import os
import platform
import statistics
import sys
import time


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def time_adamw(torch, n, foreach, reps):
    g = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=g) * 1e-3
    p.grad = torch.randn(n, generator=g) * 1e-4
    opt = torch.optim.AdamW([p], lr=1e-3, foreach=foreach)
    for _ in range(2):  # warm-up: allocates exp_avg / exp_avg_sq
        opt.step()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fused_status(torch):
    if "fused" not in inspect.signature(torch.optim.AdamW.__init__).parameters:
        note = "torch %s: AdamW has no fused option" % torch.__version__
        if "fused" in inspect.signature(torch.optim.Adam.__init__).parameters:
            p = torch.zeros(4, requires_grad=True)
            p.grad = torch.zeros(4)
            try:
                torch.optim.Adam([p], fused=True).step()
                note += "; Adam(fused=True) ran on CPU"
            except Exception as e:  # noqa: BLE001 - record whatever torch says
                note += "; Adam(fused=True) on CPU: %s" % str(e).splitlines()[0]
        return False, note
    return True, "AdamW has a fused option"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", required=True)
    ap.add_argument("--reps", type=int, default=0)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    try:
        import torch
    except ImportError as e:
        print("torch_optim: torch is not importable (%s); skipped" % e)
        if a.out:
            with open(a.out, "w") as f:
                json.dump({"bench": "torch_optim", "skipped": str(e)}, f)
        return 0
    sizes = [int(s) for s in a.sizes.split(",") if s]
    fused_ok, fused_note = fused_status(torch)
    rows = []
    for n in sizes:
        reps = a.reps or max(5, min(40, int(1.5e9 / (n * 28))))
        for foreach in (False, True):
            t = time_adamw(torch, n, foreach, reps)
            rows.append({"optimizer": "adamw", "dtype": "fp32", "numel": n,
                         "foreach": foreach, "reps": reps, "step_s": t,
                         "elements_per_s": n / t,
                         "effective_GBps": n * 28 / t / 1e9})
    print("\ntorch.optim.AdamW on CPU — torch %s, %d thread(s), %s"
          % (torch.__version__, torch.get_num_threads(), cpu_model()))
    print("%10s %8s %10s %9s %8s" % ("elements", "foreach", "step ms", "Melem/s", "GB/s"))
    for r in rows:
        print("%10d %8s %10.2f %9.1f %8.2f" % (r["numel"], r["foreach"],
              r["step_s"] * 1e3, r["elements_per_s"] / 1e6, r["effective_GBps"]))
    print("fused: %s" % fused_note)
    doc = {"bench": "torch_optim", "torch": torch.__version__,
           "threads": torch.get_num_threads(), "cpu": cpu_model(),
           "ncpu": os.cpu_count(), "fused_available": fused_ok,
           "fused_note": fused_note, "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=2)
        print("(results: %s)" % a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
