"""Backward prefetch (FSDP's BackwardPrefetch.BACKWARD_PRE) on transient
areas: when a unit's backward begins, the gather of the unit before it in
this step's forward is already under way, with its gradient area. Ranks
are processes (forkserver) of one job on the host backend; each run is
compared to the same run without backward prefetch, bit for bit, and the
LLaMA one to single-process torch AdamW on the ranks' gradient mean;
and forward prefetch after prefetch="auto"'s trial, which the ranks agree on
the same way."""
import enum
import unittest

import common
import shardd

if common.HAVE_TORCH:
    import numpy as np
    import torch
    import torch.utils.checkpoint
    from torch import nn
    import shardd.nn
    import shardd.optim
    import models

STEPS = 4
ROWS = 4
HYPER = dict(lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)


# ---- models: no parameter of the root's own, so no root unit holds a lease
# through backward and the next unit's gather finds one ---------------------

def llama():
    """Untied LLaMA, a unit per decoder layer and for the embedding, the
    final norm and the head."""
    cfg = models.LlamaConfig(layers=3)
    return models.llama(cfg), cfg


def llama_policy(model):
    mods = {id(model.model.embed_tokens), id(model.model.norm), id(model.lm_head)}
    mods |= {id(m) for m in model.model.layers}
    return lambda m, recurse, numel: recurse or id(m) in mods


if common.HAVE_TORCH:
    class Mix(nn.Module):
        """A frozen unit, two units whose order flips on odd steps, one of
        them used twice, one under activation checkpointing, and one whose
        output the loss does not use (a backward prefetch's wrong guess)."""

        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(8, 16)
            self.frozen = nn.Linear(16, 16)
            self.a = nn.Linear(16, 16)
            self.b = nn.Linear(16, 16)
            self.c = nn.Linear(16, 16)
            self.side = nn.Linear(16, 16)
            self.out = nn.Linear(16, 4)
            for p in self.frozen.parameters():
                p.requires_grad_(False)
            self.flip = False

        def forward(self, x):
            h = torch.tanh(self.inp(x))
            h = torch.tanh(self.frozen(h))
            for m in ((self.b, self.a) if self.flip else (self.a, self.b)):
                h = torch.tanh(m(h))
            h = torch.utils.checkpoint.checkpoint(self.c, h, use_reentrant=False)
            h = torch.tanh(self.a(h))
            self.side(h)  # computed, hooked, never in the loss
            return self.out(h)


def mix():
    torch.manual_seed(0)
    return Mix(), None


if common.HAVE_TORCH:
    class ReentrantGPT(models.GPT):
        """nanoGPT, untied, its blocks under reentrant checkpointing: their
        forwards run without grad, so they are not in the forward's order
        and the guess after the final norm is wrong (a block's
        recomputation comes next, not wpe)."""

        def __init__(self, cfg):
            super().__init__(cfg)
            self.transformer.wte.weight = nn.Parameter(self.lm_head.weight.detach().clone())

        def forward(self, idx):
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.transformer.wte(idx) + self.transformer.wpe(pos)
            for block in self.transformer.h:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)
            return self.lm_head(self.transformer.ln_f(x))


def gpt():
    cfg = models.GPTConfig(layers=3)
    torch.manual_seed(cfg.seed)
    return ReentrantGPT(cfg), cfg


def gpt_policy(model):
    t = model.transformer
    mods = {id(t.wte), id(t.wpe), id(t.ln_f), id(model.lm_head)} | {id(b) for b in t.h}
    return lambda m, recurse, numel: recurse or id(m) in mods


def nanogpt():
    """nanoGPT as it is: wte tied to the head, so the root unit holds
    them (and wpe, ln_f) from forward to backward."""
    cfg = models.GPTConfig(layers=3)
    return models.nano_gpt(cfg), cfg


def untied_gpt():
    """nanoGPT, untied, without checkpointing: with a unit per embedding,
    Block, norm and head, the root holds no lease and every unit's gather
    but the first can be prefetched."""
    cfg = models.GPTConfig(layers=3)
    torch.manual_seed(cfg.seed)
    model = models.GPT(cfg)
    model.transformer.wte.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    return model, cfg


MODELS = {"llama": (llama, llama_policy), "mix": (mix, lambda m: "children"),
          "gpt": (gpt, gpt_policy), "nanogpt": (nanogpt, lambda m: {models.Block}),
          "untied_gpt": (untied_gpt, gpt_policy)}
GPTS = ("llama", "gpt", "nanogpt", "untied_gpt")


def batch(name, cfg, step, rank, world):
    if name in GPTS:
        return models.gpt_batch(cfg, step, rank, world, ROWS)
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(world * ROWS, 8, generator=g)
    y = torch.randn(world * ROWS, 4, generator=g)
    return x[rank * ROWS:(rank + 1) * ROWS], y[rank * ROWS:(rank + 1) * ROWS]


def loss_of(name, model, x, y):
    if name in GPTS:
        return models.gpt_loss(model, x, y)
    return nn.functional.mse_loss(model(x), y)


def reference(name, world):
    """Single-process torch AdamW on the ranks' gradient mean (each rank's
    gradient on its own, summed in rank order, as the reduction adds)."""
    torch.set_num_threads(1)
    model, cfg = MODELS[name][0]()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, foreach=False, **HYPER)
    losses = []
    for s in range(STEPS):
        if name == "mix":
            model.flip = s % 2 == 1
        total, grads = 0.0, None
        for r in range(world):
            opt.zero_grad()
            x, y = batch(name, cfg, s, r, world)
            loss = loss_of(name, model, x, y)
            loss.backward()
            total += loss.item()
            g = [None if p.grad is None else p.grad.clone() for p in params]
            grads = g if grads is None else [None if a is None else a + b
                                             for a, b in zip(grads, g)]
        for p, g in zip(params, grads):
            p.grad = None if g is None else g / world
        opt.step()
        losses.append(total / world)
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}, losses


# ---- one rank ------------------------------------------------------------------

def _logged(client, log, names):
    """client's gathers and scatters, logged in the order this rank sends
    them: (call, unit name, want_grad)."""
    def wrap(call, fn):
        def inner(buffer, *a, **kw):
            log.append((call, names.get(buffer.id, buffer.id), bool(kw.get("want_grad"))))
            return fn(buffer, *a, **kw)
        return inner
    for call in ("gather_async", "gather_area", "scatter"):
        setattr(client, call, wrap(call, getattr(client, call)))


def rank_main(rank, world, sock, job, name, bwd, q, extra):
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=world, transient_areas=True,
                               client_name="test_backward_prefetch rank %d" % rank)
        model, cfg = MODELS[name][0]()
        bp = bwd[rank] if isinstance(bwd, (list, tuple)) else bwd
        cost = extra["costs"][rank] if extra.get("costs") else None
        sm = shardd.nn.ShardedModule(client, model, auto_wrap=MODELS[name][1](model),
                                     prefetch=extra.get("prefetch", "auto" if cost else False),
                                     backward_prefetch=bp)
        if cost:  # prefetch="auto"'s trial under a clock that makes one side faster
            common.fake_trial_clock(sm, cost)
        if "cpus" in extra:  # what prefetch="auto" counts (ShardedModule._spare_cpu)
            sm._cpus = lambda: extra["cpus"]
        opt = shardd.optim.AdamW([p for p in model.parameters() if p.requires_grad], **HYPER)
        log = []
        _logged(client, log, {u.buffer.id: u.name for u in sm.units})
        agreed = []
        for s in range(extra.get("steps", STEPS)):
            if name == "mix":
                model.flip = s % 2 == 1  # the forward's order differs from the last step's
            x, y = batch(name, cfg, s, rank, world)
            del log[:]
            opt.zero_grad()
            agreed.append(sm.backward_prefetch)
            if extra.get("no_sync"):  # two backwards, the first in no_sync()
                h = ROWS // 2
                with sm.no_sync():
                    (loss_of(name, model, x[:h], y[:h]) / 2).backward()
                loss = loss_of(name, model, x[h:], y[h:]) / 2
            else:
                loss = loss_of(name, model, x, y)
            loss.backward()
            held = [u.name for u in sm.units if u.gather is not None or u.grad is not None]
            opt.step()
            q.put(("loss", rank, s, loss.item(), held, list(log) if rank == 0 else None))
            if extra.get("evals"):  # evaluations between steps
                with torch.no_grad():
                    loss_of(name, model, x, y)
                model.eval()
                loss_of(name, model, x, y)  # grad enabled, no backward
                model.train()
        params = sm.full_parameters()
        q.put(("prefetch", rank, sm.backward_prefetches, agreed, sm.prefetch, sm.prefetches,
               sm.prefetch_trial))
        if rank == 0:
            q.put(("params", {n: t.numpy().copy() for n, t in params.items()},
                   [u.name for u in sm.units]))
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


def run(name, bwd, world=2, timeout=150, **extra):
    job = common.job("bwdpf")
    sock = common.socket()
    steps = {}
    n = extra.get("steps", STEPS)
    out = {"losses": [None] * n, "held": [], "logs": [None] * n, "counts": {},
           "agreed": {}, "forward": {}, "trials": {}}

    def on_msg(msg):
        if msg[0] == "loss":
            _, r, s, loss, held, log = msg
            out["held"].extend(held)
            if log is not None:
                out["logs"][s] = log
            steps.setdefault(s, {})[r] = loss
            if len(steps[s]) == world:
                out["losses"][s] = sum(steps.pop(s).values()) / world
        elif msg[0] == "prefetch":
            out["counts"][msg[1]], out["agreed"][msg[1]] = msg[2], msg[3]
            out["forward"][msg[1]] = (msg[4], msg[5])
            out["trials"][msg[1]] = msg[6]
        elif msg[0] == "params":
            out["params"], out["units"] = msg[1], msg[2]

    common.launch_ranks(rank_main, lambda r, q: (r, world, sock, job, name, bwd, q, extra),
                        world, on_msg, timeout)
    return out


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class BackwardPrefetchTest(unittest.TestCase):
    def same(self, got, want, label):
        self.assertEqual(got["losses"], want["losses"], label)
        self.assertEqual(sorted(got["params"]), sorted(want["params"]))
        for n, v in want["params"].items():
            np.testing.assert_array_equal(got["params"][n], v, err_msg="%s: %s" % (label, n))
        self.assertEqual(got["held"], [], "%s: areas held after a backward" % label)

    def test_llama_next_gather_is_sent_before_the_current_unit_s_backward_ends(self):
        """Untied LLaMA, 3 decoder layers, a unit each (and embedding,
        norm, head), 2 ranks: from the second backward on (the ranks agree
        at the end of each), each unit's backward starts the gather of the
        unit before it in the forward, with its gradient area, before its
        own reduce-scatter; results equal the run without, bit for bit, and
        single-process torch."""
        on = run("llama", True, evals=True)
        off = run("llama", False, evals=True)
        self.same(on, off, "llama with backward prefetch against without")
        want, want_losses = reference("llama", 2)
        for n, v in want.items():
            np.testing.assert_array_equal(on["params"][n], v, err_msg=n)
        self.assertEqual(on["losses"], off["losses"])
        for a, b in zip(on["losses"], want_losses):
            self.assertLessEqual(abs(a - b) / abs(b), 1e-6)
        self.assertEqual(on["agreed"][0], [False] + [True] * (STEPS - 1))
        self.assertEqual(off["agreed"][0], [False] * STEPS)
        # backward runs head, norm, layers 2, 1, 0, embedding: 5 of the 6
        # gathers of each backward after the first were under way
        units = on["units"]
        self.assertEqual(on["counts"], {0: 5 * (STEPS - 1), 1: 5 * (STEPS - 1)}, units)
        self.assertEqual(off["counts"], {0: 0, 1: 0})
        order = ["lm_head", "model.norm", "model.layers.2", "model.layers.1",
                 "model.layers.0", "model.embed_tokens"]
        for s in range(1, STEPS):
            log = on["logs"][s]
            for cur, nxt in zip(order, order[1:]):
                sent = log.index(("gather_async", nxt, True))
                done = log.index(("scatter", cur, False))
                self.assertLess(sent, done, "step %d: %s's gather after %s's scatter: %s"
                                % (s, nxt, cur, log))
            # only the first backward (the head's) gathers on demand
            self.assertEqual([n for c, n, g in log if g and c == "gather_area"], ["lm_head"],
                             log)
        # without: each backward gathers on demand, after the scatter before
        log = off["logs"][1]
        self.assertLess(log.index(("scatter", "model.layers.2", False)),
                        log.index(("gather_area", "model.layers.1", True)), log)

    def test_mixed_model_matches_without_prefetch(self):
        """A frozen unit, a unit used twice, activation checkpointing, a
        forward whose order flips every step, a unit whose output the loss
        does not use (the guess after the head is wrong every step) and
        evaluations between steps: bit for bit the run without backward
        prefetch, no area held after a backward, no hang."""
        on = run("mix", True, evals=True)
        off = run("mix", False, evals=True)
        self.same(on, off, "mix with backward prefetch against without")
        want, want_losses = reference("mix", 2)
        for n, v in want.items():
            np.testing.assert_array_equal(on["params"][n], v, err_msg=n)
        self.assertEqual(on["agreed"][0], [False] + [True] * (STEPS - 1))
        self.assertGreater(on["counts"][0], 0, "no backward found its gather under way")

    def test_reentrant_checkpointed_gpt_matches_without_prefetch(self):
        """nanoGPT (untied), a unit per embedding, block, norm and head,
        blocks under reentrant checkpointing (not in the forward's order:
        a wrong guess each step): bit for bit the run without and
        single-process torch."""
        on = run("gpt", True)
        off = run("gpt", False)
        self.same(on, off, "gpt with backward prefetch against without")
        want, _ = reference("gpt", 2)
        for n, v in want.items():
            np.testing.assert_array_equal(on["params"][n], v, err_msg=n)
        self.assertGreater(on["counts"][0], 0)

    def test_no_sync_accumulation_matches_without_prefetch(self):
        """Two backwards a step, the first in no_sync() (FSDP scripts'
        gradient accumulation): each prefetches from the second step on,
        bit for bit the run without."""
        on = run("llama", True, no_sync=True)
        off = run("llama", False, no_sync=True)
        self.same(on, off, "llama, no_sync, with backward prefetch against without")
        self.assertEqual(on["counts"][0], 2 * 5 * STEPS - 5)

    def test_ranks_that_disagree_prefetch_in_no_backward(self):
        """Rank 0 asks for backward prefetch, rank 1 not: the ranks agree
        on none (every rank must want it), so no rank sends a gather its
        peer does not."""
        res = run("llama", [True, False])
        self.assertEqual(res["counts"], {0: 0, 1: 0})
        self.assertEqual(res["agreed"][0], [False] * STEPS)
        self.assertEqual(res["agreed"][1], [False] * STEPS)

    def test_ranks_whose_trials_chose_differently_prefetch_no_forward(self):
        """prefetch="auto"'s trial under clocks on which rank 0 finds
        prefetching faster and rank 1 slower, on the model whose forward
        flips its order every step (so a prefetching rank guesses wrong):
        after the trial neither rank prefetches (every rank must have
        chosen it), where rank 0 used to prefetch alone and wait for a
        gather rank 1 sent later (E_MISMATCH after --peer-grace); results
        equal the run that never prefetches."""
        steps = 10  # 1 learns the order, 6 of trial, 3 after its choice
        res = run("mix", False, steps=steps,
                  costs=[{"on": 1.0, "off": 2.0}, {"on": 2.0, "off": 1.0}])
        plain = run("mix", False, steps=steps)
        self.same(res, plain, "rank-chosen forward prefetch against none")
        self.assertEqual({r: f[0] for r, f in res["forward"].items()}, {0: True, 1: False})
        # the 3 trial steps with prefetch each prefetched the same units on
        # both ranks (the first forward's order guessed right half the
        # time); none after the choice
        self.assertEqual(res["forward"][0][1], res["forward"][1][1])

    def test_forward_prefetch_auto_true_and_false_train_the_same_parameters(self):
        """nanoGPT (tied, a unit per Block: its root unit holds a lease, so
        only the first Block's gather is prefetched, while the embeddings
        compute) and the untied GPT with a unit per
        embedding, Block, norm and head (6 of its 7 gathers a step prefetched), 2
        ranks, 9 steps, backward_prefetch="auto" (forward prefetch's
        choice): prefetch=False, True, and "auto" where the trial keeps
        prefetch (a clock on which it is faster) and where the node has no
        spare CPU (2 CPUs for 2 ranks of 1 thread: no trial, no prefetch)
        give the same losses and parameters, bit for bit."""
        steps = 9
        fast = {"on": 1.0, "off": 2.0}
        for name in ("nanogpt", "untied_gpt"):
            off = run(name, "auto", steps=steps, prefetch=False)
            runs = {"prefetch=True": run(name, "auto", steps=steps, prefetch=True),
                    "auto, trial kept prefetch": run(name, "auto", steps=steps,
                                                     costs=[fast, fast]),
                    "auto, no spare CPU": run(name, "auto", steps=steps,
                                              prefetch="auto", cpus=2)}
            for label, res in runs.items():
                self.same(res, off, "%s, %s against prefetch=False" % (name, label))
            kept, none = runs["auto, trial kept prefetch"], runs["auto, no spare CPU"]
            self.assertEqual({r: f[0] for r, f in kept["forward"].items()}, {0: True, 1: True})
            self.assertEqual(none["forward"], {0: (False, 0), 1: (False, 0)})
            self.assertEqual(none["counts"], {0: 0, 1: 0})
            self.assertFalse(none["trials"][0]["spare_cpu"])
            self.assertEqual(off["forward"], {0: (False, 0), 1: (False, 0)})
            always = runs["prefetch=True"]
            if name == "untied_gpt":  # 7 units: 6 prefetched a forward from the second on
                self.assertEqual(always["forward"][0], (True, 6 * (steps - 1)))
                self.assertGreater(kept["forward"][0][1], always["forward"][0][1] // 2)
                self.assertGreater(always["counts"][0], 0)
            else:
                self.assertEqual(always["forward"][0], (True, steps - 1))

    def test_option_values(self):
        c = shardd.nn.ShardedModule._backward_prefetch_option
        self.assertIs(c(None), False)
        self.assertEqual(c("auto"), "auto")
        # torch.distributed.fsdp.BackwardPrefetch's members (torch 1.13's
        # fsdp package does not import on Python 3.11: a dataclass default)
        BackwardPrefetch = enum.Enum("BackwardPrefetch", "BACKWARD_PRE BACKWARD_POST")
        self.assertIs(c(BackwardPrefetch.BACKWARD_PRE), True)
        with self.assertRaises(ValueError):
            c(BackwardPrefetch.BACKWARD_POST)
        with self.assertRaises(ValueError):
            c("yes")


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class OneRankTest(unittest.TestCase):
    def test_reset_forgets_what_the_ranks_agreed(self):
        """sm.reset() (the recovery after E_PEER_LOST, while a rank is
        relaunched) drops the agreement made with the rank that died: no
        rank prefetches until all, the new one too, have agreed again."""
        client = shardd.Client(common.socket(), job=common.job("bwdpf1"), rank=0, world=1,
                               transient_areas=True)
        self.addCleanup(client.close)
        model, _ = mix()
        sm = shardd.nn.ShardedModule(client, model, auto_wrap="children", prefetch=True,
                                     backward_prefetch=True)
        x, y = batch("mix", None, 0, 0, 1)
        self.assertFalse(sm.backward_prefetch)
        loss_of("mix", model, x, y).backward()
        self.assertTrue(sm.backward_prefetch)
        sm.reset()
        self.assertFalse(sm.backward_prefetch)
        self.assertFalse(sm._fw_agreed)
        loss_of("mix", model, x, y).backward()  # agreed again
        self.assertTrue(sm.backward_prefetch)

    def test_what_the_ranks_chose_is_read_only(self):
        """backward_prefetch (what the ranks agreed) and prefetch were
        writable attributes: set on one rank only, it would send gathers
        its peers do not (a wrong guess waits for a gather they send later
        or never). Setting either raises, naming the constructor option,
        and changes nothing."""
        client = shardd.Client(common.socket(), job=common.job("bwdpf2"), rank=0, world=1,
                               transient_areas=True)
        self.addCleanup(client.close)
        model, _ = mix()
        sm = shardd.nn.ShardedModule(client, model, auto_wrap="children", prefetch=False,
                                     backward_prefetch=False)
        for attr in ("backward_prefetch", "prefetch"):
            with self.assertRaises(AttributeError) as cm:
                setattr(sm, attr, True)
            self.assertIn("constructor's %s=" % attr, str(cm.exception))
            self.assertIs(getattr(sm, attr), False)
        x, y = batch("mix", None, 0, 0, 1)
        loss_of("mix", model, x, y).backward()
        self.assertFalse(sm.backward_prefetch)
        self.assertEqual(sm.backward_prefetches, 0)


if __name__ == "__main__":
    unittest.main()
