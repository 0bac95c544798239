#!/usr/bin/python3
"""Generates tests/unit/optim_golden.h: torch.optim golden vectors for the optim module.

Regenerate (needs torch 1.13 and numpy; CI's C tests only read the header):

    /usr/bin/python3 tests/gen/optim_golden.py > tests/unit/optim_golden.h

What it writes, all floats as IEEE-754 bit patterns so nothing is lost in
printing:
  - one initial parameter vector and a per-step gradient sequence (fixed seed,
    magnitudes spread over several decades, a few exact zeros), shared by every
    case;
  - for each optimizer case the hyperparameters, the grad_scale, the fp32
    parameter after every step and the optimizer state after the last step,
    produced by torch.optim's single-tensor (foreach=False) code path;
  - torch.optim's defaults for SGD / Adam / AdamW;
  - fp32 inputs with their bf16 and fp16 bit patterns from torch's .to() and
    the fp32 values those convert back to.

Determinism: the data come from a seeded numpy Generator and torch runs on
one thread with ATEN_CPU_CAPABILITY=avx2, the kernels torch picks on any x86
CPU with AVX2 (AVX-512 ones give the same bits here): they fuse add-with-alpha
and addcmul_ into one fused multiply-add, in the vector body and the scalar
tail alike, and so does kernels/optim.c on every path, so test_optim asserts
these values bit for bit. The generating machine must have AVX2 and FMA: the
script refuses to write when torch reports another capability (torch falls
back silently). --capability default writes torch's non-SIMD values (every
operation rounded on its own), for measuring how far those are from ours.
"""
import argparse
import os
import sys

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--capability", default="avx2",
                help="ATEN_CPU_CAPABILITY for torch (default: avx2)")
args = ap.parse_args()
os.environ["ATEN_CPU_CAPABILITY"] = args.capability

import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

_used = [ln.split(":", 1)[1].strip() for ln in torch.__config__.show().splitlines()
         if "CPU capability usage" in ln]
if _used != [{"default": "NO AVX"}.get(args.capability, args.capability.upper())]:
    sys.exit("optim_golden.py: torch uses CPU capability %s, not %s (no AVX2/FMA here?)"
             % (_used, args.capability.upper()))

N = 37
STEPS = 5
SEED = 20240531


def bits(t):
    a = np.ascontiguousarray(t.detach().numpy().astype(np.float32).reshape(-1))
    return [int(x) for x in a.view(np.uint32)]


def from_bits(b):
    return torch.from_numpy(np.array(b, dtype=np.uint32).view(np.float32).copy())


rng = np.random.default_rng(SEED)
param0 = (rng.standard_normal(N) * 0.5).astype(np.float32)
grads = []
for s in range(STEPS):
    mag = 10.0 ** rng.uniform(-3.0, 1.0, N)
    g = (rng.standard_normal(N) * mag).astype(np.float32)
    g[(s * 7) % N] = 0.0  # an exact zero somewhere different each step
    grads.append(g)

# (name, kind, hyperparameters, grad_scale)
CASES = [
    ("sgd_plain", "SGD", dict(lr=0.1), 1.0),
    ("sgd_momentum_dampening", "SGD", dict(lr=0.05, momentum=0.9, dampening=0.1), 1.0),
    ("sgd_nesterov", "SGD", dict(lr=0.05, momentum=0.9, nesterov=True), 1.0),
    ("sgd_wd", "SGD", dict(lr=0.1, weight_decay=0.01), 1.0),
    ("sgd_maximize", "SGD", dict(lr=0.1, momentum=0.8, maximize=True), 1.0),
    ("sgd_nesterov_wd_scaled", "SGD",
     dict(lr=0.02, momentum=0.7, weight_decay=1e-3, nesterov=True), 0.3712),
    ("adam", "Adam", dict(lr=1e-2), 1.0),
    ("adam_amsgrad", "Adam", dict(lr=1e-2, amsgrad=True), 1.0),
    ("adam_wd", "Adam", dict(lr=1e-2, weight_decay=0.1), 1.0),
    ("adam_maximize", "Adam", dict(lr=1e-2, maximize=True), 1.0),
    ("adam_betas_eps_scaled", "Adam",
     dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01), 0.4567),
    ("adamw", "AdamW", dict(lr=1e-2, weight_decay=0.05), 1.0),
    ("adamw_amsgrad", "AdamW", dict(lr=1e-2, weight_decay=0.05, amsgrad=True), 1.0),
    ("adamw_maximize_amsgrad", "AdamW",
     dict(lr=2e-2, betas=(0.85, 0.995), maximize=True, amsgrad=True), 1.0),
]

OPT = {"SGD": torch.optim.SGD, "Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}
KIND = {"SGD": "SHARDD_OPTIM_SGD", "Adam": "SHARDD_OPTIM_ADAM", "AdamW": "SHARDD_OPTIM_ADAMW"}
STATE_KEYS = {"SGD": ["momentum_buffer"],
              "Adam": ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"],
              "AdamW": ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"]}


def resolved(kind, hp):
    """The full hyperparameter set torch used (its defaults filled in)."""
    p = torch.zeros(1, requires_grad=True)
    extra = {} if kind != "SGD" else {"lr": hp.get("lr", 1e-3)}
    d = dict(OPT[kind]([p], **{**extra, **hp}).defaults)
    out = dict(lr=float(d["lr"]), momentum=float(d.get("momentum", 0.0)),
               dampening=float(d.get("dampening", 0.0)),
               weight_decay=float(d["weight_decay"]),
               beta1=float(d["betas"][0]) if "betas" in d else 0.0,
               beta2=float(d["betas"][1]) if "betas" in d else 0.0,
               eps=float(d.get("eps", 0.0)), nesterov=int(d.get("nesterov", False)),
               maximize=int(d.get("maximize", False)),
               amsgrad=int(d.get("amsgrad", False)))
    return out


def run_case(kind, hp, scale):
    p = torch.nn.Parameter(torch.from_numpy(param0.copy()))
    opt = OPT[kind]([p], foreach=False, **hp)
    scale_t = torch.tensor(scale, dtype=torch.float32)
    per_step = []
    for g in grads:
        p.grad = torch.from_numpy(g.copy())
        if scale != 1.0:
            # what clip_grad_norm_ does to every grad before the step
            p.grad.detach().mul_(scale_t)
        opt.step()
        per_step.append(bits(p))
    st = opt.state[p]
    states = [bits(st[k]) for k in STATE_KEYS[kind] if k in st and st[k] is not None]
    if kind != "SGD" and not hp.get("amsgrad", False):
        states = states[:2]
    return per_step, states, int(np.float32(scale).view(np.uint32))


def c_arr(vals, per_line=6, indent="    "):
    lines = []
    for i in range(0, len(vals), per_line):
        lines.append(indent + ", ".join("0x%08xu" % v for v in vals[i:i + per_line]) + ",")
    return "\n".join(lines)


def c_arr16(vals, per_line=10, indent="    "):
    lines = []
    for i in range(0, len(vals), per_line):
        lines.append(indent + ", ".join("0x%04xu" % v for v in vals[i:i + per_line]) + ",")
    return "\n".join(lines)


def conv_inputs():
    f = lambda x: int(np.float32(x).view(np.uint32))  # noqa: E731
    v = [0x00000000, 0x80000000, 0x7f800000, 0xff800000, 0x7fc00000, 0xffc00001,
         0x00000001, 0x807fffff, 0x00800000, 0x7f7fffff, 0xff7fffff,
         f(1.0), f(-1.0), f(65504.0), f(65519.996), f(65520.0), f(-65536.0),
         f(6.1035156e-05), f(5.9604645e-08), f(2.9802322e-08), f(2.98023259e-08),
         f(8.9406967e-08), f(1e-10), f(3.14159265), f(-2.71828183), f(1e30)]
    # bf16 ties: low half exactly 0x8000 with even and odd kept bit
    v += [0x3f808000, 0x3f818000, 0xbf808000, 0x3f807fff, 0x3f808001,
          0x7f7f8000, 0x7f7f7fff]
    # fp16 ties in the normal range: low 13 bits 0x1000 with even/odd kept bit
    v += [0x3f801000, 0x3f803000, 0x3f800fff, 0x3f801001, 0x477fe000, 0x477ff000,
          0x477fefff]
    # fp16 subnormal ties: 1.5 and 2.5 times the smallest subnormal, and below
    v += [f(1.5 * 2.0 ** -24), f(2.5 * 2.0 ** -24), f(0.5 * 2.0 ** -24),
          f(2.0 ** -15 + 2.0 ** -25), f(1023.5 * 2.0 ** -24)]
    r = np.random.default_rng(SEED + 1)
    v += [int(x) for x in r.integers(0, 2 ** 32, 64, dtype=np.uint64)]
    v += bits(torch.from_numpy((r.standard_normal(40) * 10.0 ** r.uniform(-9, 6, 40))
                               .astype(np.float32)))
    return v


def main():
    o = []
    w = o.append
    w("/* optim_golden.h — torch.optim golden vectors for tests/unit/test_optim.c.")
    w(" * GENERATED by tests/gen/optim_golden.py (torch %s, ATEN_CPU_CAPABILITY=%s);"
      % (torch.__version__, args.capability))
    w(" * do not edit. Regenerate: /usr/bin/python3 tests/gen/optim_golden.py"
      " > tests/unit/optim_golden.h */")
    w("#ifndef OPTIM_GOLDEN_H")
    w("#define OPTIM_GOLDEN_H")
    w("")
    w("#include <stdint.h>")
    w("")
    w('#include "shardd.h"')
    w("")
    w("#define OPTIM_GOLDEN_N %d" % N)
    w("#define OPTIM_GOLDEN_STEPS %d" % STEPS)
    w("")
    w("static const uint32_t optim_golden_param0[OPTIM_GOLDEN_N] = {")
    w(c_arr(bits(torch.from_numpy(param0))))
    w("};")
    w("")
    w("static const uint32_t optim_golden_grad[OPTIM_GOLDEN_STEPS][OPTIM_GOLDEN_N] = {")
    for g in grads:
        w("  {")
        w(c_arr(bits(torch.from_numpy(g))))
        w("  },")
    w("};")
    w("")
    w("typedef struct {")
    w("  const char *name;")
    w("  shardd_optim_kind kind;")
    w("  double lr, momentum, dampening, weight_decay, beta1, beta2, eps;")
    w("  int nesterov, maximize, amsgrad;")
    w("  uint32_t grad_scale; /* float bits */")
    w("  uint32_t param[OPTIM_GOLDEN_STEPS][OPTIM_GOLDEN_N]; /* after each step */")
    w("  int nstate;")
    w("  uint32_t state[3][OPTIM_GOLDEN_N]; /* after the last step */")
    w("} optim_golden_case;")
    w("")
    w("static const optim_golden_case optim_golden_cases[] = {")
    for name, kind, hp, scale in CASES:
        r = resolved(kind, hp)
        per_step, states, scale_bits = run_case(kind, hp, scale)
        w("  {")
        w('    "%s", %s,' % (name, KIND[kind]))
        w("    %r, %r, %r, %r, %r, %r, %r," % (r["lr"], r["momentum"], r["dampening"],
                                              r["weight_decay"], r["beta1"], r["beta2"],
                                              r["eps"]))
        w("    %d, %d, %d," % (r["nesterov"], r["maximize"], r["amsgrad"]))
        w("    0x%08xu," % scale_bits)
        w("    {")
        for ps in per_step:
            w("      {")
            w(c_arr(ps, indent="        "))
            w("      },")
        w("    },")
        w("    %d," % len(states))
        w("    {")
        for s in states:
            w("      {")
            w(c_arr(s, indent="        "))
            w("      },")
        w("    },")
        w("  },")
    w("};")
    w("#define OPTIM_GOLDEN_NCASES (sizeof optim_golden_cases / sizeof optim_golden_cases[0])")
    w("")
    w("/* torch.optim defaults; SGD's lr is required in torch, ours is 1e-3. */")
    w("typedef struct {")
    w("  shardd_optim_kind kind;")
    w("  double lr, momentum, dampening, weight_decay, beta1, beta2, eps;")
    w("  int nesterov, maximize, amsgrad;")
    w("} optim_golden_defaults;")
    w("")
    w("static const optim_golden_defaults optim_golden_default_hp[] = {")
    for kind in ("SGD", "Adam", "AdamW"):
        r = resolved(kind, {})
        w("  {%s, %r, %r, %r, %r, %r, %r, %r, %d, %d, %d}," % (
            KIND[kind], r["lr"], r["momentum"], r["dampening"], r["weight_decay"],
            r["beta1"], r["beta2"], r["eps"], r["nesterov"], r["maximize"], r["amsgrad"]))
    w("};")
    w("")
    v = conv_inputs()
    t = from_bits(v)
    bf = t.to(torch.bfloat16)
    hf = t.to(torch.float16)
    bf_bits = [int(x) & 0xffff for x in bf.view(torch.int16).numpy()]
    hf_bits = [int(x) & 0xffff for x in hf.view(torch.int16).numpy()]
    w("/* fp32 inputs, torch's bf16 / fp16 of them, and those back in fp32. torch's")
    w(" * NaN bit patterns differ between its scalar and SIMD paths, so tests only")
    w(" * require NaN to stay NaN. */")
    w("#define OPTIM_GOLDEN_NCONV %d" % len(v))
    w("static const uint32_t optim_golden_conv_f32[OPTIM_GOLDEN_NCONV] = {")
    w(c_arr(v))
    w("};")
    w("static const uint16_t optim_golden_conv_bf16[OPTIM_GOLDEN_NCONV] = {")
    w(c_arr16(bf_bits))
    w("};")
    w("static const uint32_t optim_golden_conv_bf16_f32[OPTIM_GOLDEN_NCONV] = {")
    w(c_arr(bits(bf.float())))
    w("};")
    w("static const uint16_t optim_golden_conv_fp16[OPTIM_GOLDEN_NCONV] = {")
    w(c_arr16(hf_bits))
    w("};")
    w("static const uint32_t optim_golden_conv_fp16_f32[OPTIM_GOLDEN_NCONV] = {")
    w(c_arr(bits(hf.float())))
    w("};")
    w("")
    w("#endif /* OPTIM_GOLDEN_H */")
    sys.stdout.write("\n".join(o) + "\n")


main()
