"""The daemon's memory on the model shapes people train, byte for byte:
with a default Client (transient areas, FSDP's FULL_SHARD) and fp32 AdamW
in the daemon, the peak over every device is 16*P + 4*(R + M)*(W + 1) --
per rank its shard, reduced-gradient shard and AdamW's two moments of
every unit (16*P in all, 16*P/W a rank), and the slots of the pools the
hooked loop makes: it holds the root unit (R parameters) and one other at
a time, gathered and with a gradient, so the node's gathered copies, which
every local rank reads, take a slot of the root's size and one of the
largest other unit's (M), and each rank's gradient areas as many. That is
below the pools' worst case, W*(2 - 1) + 1 gathered slots and 2 gradient
slots a rank of the largest unit U, 16*P + 4*U*(3*W + 1), which the job
reserves against its memory limits (FSDP's own bound, a gathered copy per
rank, is 16*P + 16*U*W) -- in the daemon's whole 4 KiB pages per region
(and 19 more after an area of 1 MiB or more), computed from the wrapped
model's units as the daemon lays them out (daemon_bytes), for the
nanoGPT-shaped GPT per Block, the LLaMA-shaped model per decoder layer and
the ResNet-18-shaped CNN per BasicBlock, 2 and 4 ranks; the losses are
single-process torch's, and a rank's private memory (RssAnon) grows by
less than half the model's fp32 bytes (the shards are the daemon's, the
areas shared mappings). A bf16 LLaMA with its fp32 master has its own,
18*P + 2*(R + M)*(W + 1) (FSDP's: 18*P + 8*U*W, bf16_bound). Ranks are
processes (forkserver) of one job on a daemon of the test's own (host
backend, a device per rank). The pools' worst case: see gather_slots."""
import gc
import unittest

import common
import shardd

if common.HAVE_TORCH:
    import torch
    from torch import nn
    import shardd.nn
    import shardd.optim
    import models
    from test_memory import rss_anon

STEPS = 3
ROWS = 2          # rows per rank per step
TOL = 1e-5        # the losses, relative
HYPER = dict(lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
PAGE = 4096
LEASES = 2        # the daemon's gather and gradient leases per rank


# ---- what the daemon holds (daemon/registry/) ------------

def _align(n):
    return (n + PAGE - 1) // PAGE * PAGE


def _area_end(start, nbytes):
    """shardd__area_end: the next area starts on a page, and 19 pages
    further after an area of 1 MiB or more (against cache aliasing)."""
    return _align(start + nbytes) + (19 * PAGE if nbytes >= 1 << 20 else 0)


def gather_slots(world):
    """The node's gather pool (daemon/registry/areas.c): gathers lease for
    every local rank at once, in one order, and a rank holds at most
    LEASES; when the newest held unit was last gathered every rank held at
    most LEASES - 1 others, so no more than world * (LEASES - 1) + 1 units
    are ever held, however the ranks release."""
    return world * (LEASES - 1) + 1


def loop_slots(units):
    """The units whose sizes the hooked loop's slots take (daemon/registry/
    areas.c: a slot is made, or the largest free one grown, only when no
    free slot holds the unit leased): it holds the root unit and one other
    at a time (the root from its forward to its backward, a Block, decoder
    layer or BasicBlock from its gather to its release; prefetch takes the
    next one only in the root's forward, before the first is gathered), so
    one slot is the root's and the other grows to the largest other unit.
    Each rank's gradient areas alike: the root's from its forward gather
    on, another unit's from its backward to its reduce-scatter."""
    root = [n for name, n in units if name == "root"]
    return root + [max(n for name, n in units if name != "root")]


def daemon_bytes(units, world, dtype="fp32", seeds=False):
    """The daemon's bytes over every device for a transient job of `world`
    ranks whose units (name, flat buffer elements) are `units`, with AdamW
    registered over all of them, after the hooked loop's first step: per
    unit and rank a block (its shard, then its fp32 reduced-gradient
    shard) and the optimizer's state (a 16-bit unit's fp32 master, then the
    two moments), each a region of whole pages; the node's gathered slots
    and every rank's gradient slots, one region each of the loop_slots()
    units padded to a multiple of world, in whole pages. seeds: a 16-bit
    unit's exact fp32 initial values, a region per rank held from
    registration until the first step."""
    esz = 4 if dtype == "fp32" else 2
    per_rank = 0
    for _, n in units:
        s = -(-n // world)  # the shard: the unit padded to a multiple of world
        arr = s * 4
        per_rank += _align(_area_end(0, s * esz) + arr)  # shard + reduced
        off = 0 if dtype == "fp32" else _area_end(0, arr)  # the fp32 master
        per_rank += _align(_area_end(off, arr) + arr)  # m, v
        if seeds and dtype != "fp32":
            per_rank += _align(arr)
    slots = sum(_align(-(-n // world) * world * esz) for n in loop_slots(units))
    return world * per_rank + (1 + world) * slots


def node_bound(units, world, dtype="fp32"):
    """The bound without the pages: per parameter the shard, the reduced
    gradient and AdamW's state (16*P in fp32; 18*P for a 16-bit unit with
    its fp32 master, see bf16_bound), and the node's gathered slots and
    every rank's gradient slots of the root unit R and the largest other
    M: 4*(R + M)*(W + 1) in fp32, 2*(R + M)*(W + 1) in bf16."""
    per_p, esz = (16, 4) if dtype == "fp32" else (18, 2)
    return per_p * sum(n for _, n in units) + esz * sum(loop_slots(units)) * (1 + world)


def worst_bound(units, world, dtype="fp32"):
    """The pools' worst case (what the job reserves), without the pages:
    the node's gather_slots() and every rank's LEASES gradient slots of
    the largest unit U: 16*P + 4*U*(3*W + 1) in fp32."""
    per_p, esz = (16, 4) if dtype == "fp32" else (18, 2)
    numels = [n for _, n in units]
    return per_p * sum(numels) + esz * max(numels) * (gather_slots(world) + world * LEASES)


def fsdp_bound(numels, world):
    """FSDP's bound without the pages: 16*P + 16*U*W (fp32 AdamW), a
    gathered copy per rank."""
    return 16 * sum(numels) + 16 * max(numels) * world


def bf16_bound(numels, world):
    """A bf16 unit with its fp32 master, AdamW, as FSDP holds it: per
    parameter the bf16 shard (2 bytes), the fp32 reduced gradient (4), the
    fp32 master (4) and the two fp32 moments (8): 18*P; per rank 2 gather
    and 2 gradient slots of the largest unit in bf16: 8*U*W. The daemon's
    is node_bound(.., "bf16"): the gathered copies are the node's, the
    slots the loop's."""
    return 18 * sum(numels) + 8 * max(numels) * world


# ---- the models, each with its wrap policy, batch and loss --------------------

if common.HAVE_TORCH:
    # big enough that a rank's private memory says something (what torch
    # keeps after a first forward and backward of its own, whatever the
    # model's size -- 0.3 MB for these transformers in fp32, 1.6-1.9 MB in
    # bf16, 2 MB for the convolutions -- is well under half the model),
    # small enough for a few steps on a loaded CPU: 3.4, 7.9 and 11.2 MB
    # of fp32
    GPT_CFG = models.GPTConfig(vocab=512, ctx=16, dim=128, heads=4, layers=4)
    LLAMA_CFG = models.LlamaConfig(vocab=512, ctx=8, dim=192, heads=4, layers=4)
    RESNET_WIDTH = 32

    # one batch every step: the loss falls within STEPS
    def _lm_batch(cfg):
        return lambda step, rank, world: models.gpt_batch(cfg, 0, rank, world, ROWS)

    def _lm_loss(model, x, y):
        logits = model(x).float()
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           y.reshape(-1))

    def _image_loss(model, x, y):
        return nn.functional.cross_entropy(model(x), y)

    # name -> (build, auto_wrap, batch(step, rank, world), loss, unit names)
    MODELS = {
        "gpt": (lambda: models.nano_gpt(GPT_CFG), {models.Block}, _lm_batch(GPT_CFG),
                _lm_loss, ["transformer.h.%d" % i for i in range(GPT_CFG.layers)] + ["root"]),
        "llama": (lambda: models.llama(LLAMA_CFG), {models.LlamaDecoderLayer},
                  _lm_batch(LLAMA_CFG), _lm_loss,
                  ["model.layers.%d" % i for i in range(LLAMA_CFG.layers)] + ["root"]),
        "resnet": (lambda: models.resnet(RESNET_WIDTH), {models.BasicBlock},
                   lambda step, rank, world: models.image_batch(0, rank, world, ROWS),
                   _image_loss,
                   ["layer%d.%d" % (i, j) for i in range(1, 5) for j in range(2)]
                   + ["root"]),
    }


def reference(name, world, dtype="fp32"):
    """One process of torch.optim.AdamW on the ranks' gradient mean: each
    rank's slice's gradient on its own (BatchNorm's statistics are the
    slice's, as on the ranks), summed in rank order and divided by world.
    bf16: torch's mixed precision, fp32 master weights stepped on the fp32
    casts of the bf16 model's gradients, the bf16 model their rounding.
    -> the ranks' mean loss per step."""
    torch.set_num_threads(1)
    build, _, batch, loss_of, _ = MODELS[name]
    master = build()
    params = list(master.parameters())
    run = master
    if dtype == "bf16":  # the parameters only, as the wrapper's dtype=
        run = build()
        for p in run.parameters():
            p.data = p.data.to(torch.bfloat16)
    opt = torch.optim.AdamW(params, foreach=False, **HYPER)
    losses = []
    for s in range(STEPS):
        if run is not master:
            with torch.no_grad():
                for p, q in zip(run.parameters(), params):
                    p.copy_(q)
        total, grads = 0.0, None
        for r in range(world):
            run.zero_grad(set_to_none=True)
            x, y = batch(s, r, world)
            loss = loss_of(run, x, y)
            loss.backward()
            total += loss.item()
            g = [p.grad.float() for p in run.parameters()]
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        for p, g in zip(params, grads):
            p.grad = g / world
        opt.step()
        losses.append(total / world)
    return losses


# ---- one rank ------------------------------------------------------------------

def _device_bytes(client):
    st = client.status()
    return (sum(d["peak_bytes"] for d in st["devices"]),
            sum(d["used_bytes"] for d in st["devices"]))


# every model, and the bf16 LLaMA, each on a daemon of its own, trained one
# after the other by the same rank processes (one launch per world size)
CASES = (("gpt", "fp32"), ("llama", "fp32"), ("resnet", "fp32"), ("llama", "bf16"))


def train_one(rank, world, sock, job, name, dtype, q):
    client = shardd.Client(sock, job=job, rank=rank, world=world,
                           client_name="test_memory_bound rank %d" % rank)
    build, auto_wrap, batch, loss_of, _ = MODELS[name]
    gc.collect()
    base = 0 if common.UNDER_ASAN else rss_anon()  # measured only without ASan
    model = build()
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    sm = shardd.nn.ShardedModule(client, model, auto_wrap=auto_wrap,
                                 dtype=None if dtype == "fp32" else dtype)
    units = [(u.name, u.buffer.numel) for u in sm.units]
    opt = shardd.optim.AdamW(model.parameters(), **HYPER)
    # every rank has registered its buffers and optimizer, nothing is
    # gathered yet: what the daemon holds before training
    client.barrier()
    registered = _device_bytes(client)
    client.barrier()
    for s in range(STEPS):
        x, y = batch(s, rank, world)
        opt.zero_grad()
        loss = loss_of(model, x, y)
        loss.backward()
        opt.step()
        # every rank has finished step s (the step is a collective)
        peak, used = _device_bytes(client)
        q.put(("step", (name, dtype), rank, s, loss.item(), peak, used))
    del x, y, loss
    gc.collect()
    grown = 0 if common.UNDER_ASAN else rss_anon() - base
    q.put(("rank", (name, dtype), rank, grown, model_bytes, units, registered))
    client.close()


def rank_main(rank, world, socks, jobs, q):
    try:
        torch.set_num_threads(1)
        for (name, dtype), sock, job in zip(CASES, socks, jobs):
            train_one(rank, world, sock, job, name, dtype, q)
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


def run(world):
    """Every case of CASES on a daemon of its own with a device per rank.
    -> {(name, dtype): dict(losses (mean over ranks per step), peaks, used
    (per step, after every rank's step), grown {rank: RssAnon growth},
    model_bytes, units [(name, numel)], registered (peak, used) before the
    first gather)}."""
    daemons = []
    try:
        for _ in CASES:
            daemons.append(common.own_daemon(devices=world))
        jobs = [common.job("bound") for _ in CASES]
        seen = {}
        out = {c: {k: [None] * STEPS for k in ("losses", "peaks", "used")} for c in CASES}
        for c in CASES:
            out[c]["grown"] = {}

        def on_msg(msg):
            if msg[0] == "step":
                _, c, r, s, loss, peak, used = msg
                seen.setdefault((c, s), {})[r] = (loss, peak, used)
                if len(seen[c, s]) == world:
                    got = seen.pop((c, s))
                    out[c]["losses"][s] = sum(v[0] for v in got.values()) / world
                    # the last rank to ask saw every rank's step s
                    out[c]["peaks"][s] = max(v[1] for v in got.values())
                    out[c]["used"][s] = max(v[2] for v in got.values())
            elif msg[0] == "rank":
                _, c, r, grown, model_bytes, units, registered = msg
                out[c]["grown"][r] = grown
                out[c]["model_bytes"], out[c]["units"] = model_bytes, units
                out[c]["registered"] = registered

        common.launch_ranks(rank_main, lambda r, q: (r, world, [d.socket for d in daemons],
                                                     jobs, q),
                            world, on_msg, timeout=240)
        return out
    finally:
        for d in daemons:
            d.stop()
            d.cleanup()


def rel_loss_diff(got, want):
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class MemoryBoundTest(unittest.TestCase):
    _runs = {}

    def runs(self, world):
        if world not in self._runs:
            MemoryBoundTest._runs[world] = run(world)
        return self._runs[world]

    def check_fp32(self, name):
        build = MODELS[name][0]
        P_model = sum(p.numel() for p in build().parameters())
        for world in (2, 4):
            label = "%s, %d ranks" % (name, world)
            res = self.runs(world)[name, "fp32"]
            units = res["units"]
            numels = [n for _, n in units]
            self.assertEqual([u for u, _ in units], MODELS[name][4], label)
            self.assertEqual(sum(numels), P_model, label)  # a tied weight once
            want = daemon_bytes(units, world)
            nominal = node_bound(units, world)
            worst = worst_bound(units, world)
            fsdp = fsdp_bound(numels, world)
            want_losses = reference(name, world)
            lr = rel_loss_diff(res["losses"], want_losses)
            R, M = loop_slots(units)
            print("\n  %s: %d units, P %d, U %d, R %d, M %d; daemon peak %d = %.4fx of "
                  "16*P + 4*(R + M)*(W + 1) (%d), with pages %d; %.4fx of the pools' "
                  "worst case 16*P + 4*U*(3*W + 1) (%d); %.4fx of FSDP's "
                  "16*P + 16*U*W (%d); loss rel %.2g"
                  % (label, len(numels), sum(numels), max(numels), R, M, res["peaks"][-1],
                     res["peaks"][-1] / nominal, nominal, want,
                     res["peaks"][-1] / worst, worst,
                     res["peaks"][-1] / fsdp, fsdp, lr))
            self.assertEqual(res["peaks"][-1], want, label)
            self.assertEqual(res["peaks"][0], want, "%s: peak grew after step 1" % label)
            self.assertEqual(res["used"][-1], want, label)
            self.assertLessEqual(lr, TOL, label)
            self.assertLess(res["losses"][-1], res["losses"][0], "%s trains" % label)
            if not common.UNDER_ASAN:
                self.check_private(label, res)

    def check_private(self, label, res):
        for r, grown in sorted(res["grown"].items()):
            print("  %s rank %d: private memory grew by %.2f MB (model %.2f MB fp32)"
                  % (label, r, grown / 1e6, res["model_bytes"] / 1e6))
            self.assertLess(grown, res["model_bytes"] // 2,
                            "%s rank %d: RssAnon grew by %d bytes, model %d"
                            % (label, r, grown, res["model_bytes"]))

    def test_gpt_per_block_at_the_bound(self):
        self.check_fp32("gpt")

    def test_llama_per_decoder_layer_at_the_bound(self):
        self.check_fp32("llama")

    def test_resnet_per_basic_block_at_the_bound(self):
        self.check_fp32("resnet")

    def test_bf16_llama_at_its_bound(self):
        for world in (2, 4):
            label = "bf16 llama, %d ranks" % world
            res = self.runs(world)["llama", "bf16"]
            units = res["units"]
            numels = [n for _, n in units]
            want = daemon_bytes(units, world, "bf16")
            seeded = daemon_bytes(units, world, "bf16", seeds=True)
            nominal = node_bound(units, world, "bf16")
            want_losses = reference("llama", world, "bf16")
            lr = rel_loss_diff(res["losses"], want_losses)
            print("\n  %s: P %d, U %d; after step 1 the daemon holds %d = %.4fx of "
                  "18*P + 2*(R + M)*(W + 1) (%d), with pages %d; peak %d (%.4fx), registered %d; "
                  "loss rel %.2g; losses %s, torch %s"
                  % (label, sum(numels), max(numels), res["used"][0],
                     res["used"][0] / nominal, nominal, want, res["peaks"][-1],
                     res["peaks"][-1] / nominal, res["registered"][1], lr,
                     res["losses"], want_losses))
            # after the first step: the bound, exactly, and it stays
            self.assertEqual(res["used"][0], want, label)
            self.assertEqual(res["used"][-1], want, label)
            # the peak too: each unit's exact fp32 initial values (the
            # master's seed, 4*P) move into the master when the optimizer
            # registers, so they are never held beside it (it was
            # 22*P + 8*U*W while the seed stayed until the first step)
            self.assertEqual(res["peaks"][-1], want,
                             "%s (%d would be the seed kept beside the master)"
                             % (label, seeded))
            self.assertLessEqual(lr, TOL, label)
            if not common.UNDER_ASAN:
                self.check_private(label, res)


if __name__ == "__main__":
    unittest.main()
