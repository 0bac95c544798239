"""Two (or more) forwards before one backward over a model of several
units (transient areas, 2 ranks): a loss over two batches, a siamese /
contrastive pair (z1 = model(x1); z2 = model(x2); loss(z1, z2).backward()).
Each forward's use of a unit is reduced on its own when its backward ends
(the later forward's use computes with leaves of its own), its reduced
gradient added to the sharded one: training matches one process of torch
(the ranks' mean gradient) within float rounding, on nanoGPT (a unit per
Block, its embeddings and head the root's) and an untied LLaMA-like
model (three forwards), a head one forward skips, with backward_prefetch
on and off, activation checkpointing of both kinds, a unit used twice
inside each forward, retain_graph twice, no_sync(), a shardd.optim
step, and a second forward that raises inside a unit each step; bf16
units match a backward per forward's loss but for bf16 rounding; one
forward per backward never computes on leaves. Ranks that ran different
numbers of forwards before a backward get an error saying so (the ranks'
collectives differ), and a gradient hook the script put on a parameter,
which would see one forward's part only, is refused, naming it."""
import unittest

import common
import shardd

if common.HAVE_TORCH:
    import numpy as np
    import torch
    from torch import nn
    import torch.utils.checkpoint
    import models
    import shardd.nn
    import test_torch_optim as tto

STEPS = 3
ROWS = 4          # rows per rank per batch
# parameters after STEPS AdamW steps (per tensor |a-b| / |b|, L2 norms), the
# attention's key bias left out (tto.rel_diff: its gradient is rounding)
TOL = 2e-5
HYPER = dict(lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)


if common.HAVE_TORCH:
    class VariantGPT(models.GPT):
        """nanoGPT whose blocks may be checkpointed (reentrant or not) and
        whose first block may run twice in each forward."""

        def __init__(self, cfg, ckpt=None, twice=False):
            super().__init__(cfg)
            self.ckpt, self.twice = ckpt, twice

        def _block(self, block, x):
            if self.ckpt is None:
                return block(x)
            return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.ckpt)

        def forward(self, idx):
            t = idx.shape[1]
            pos = torch.arange(t, device=idx.device)
            x = self.transformer.wte(idx) + self.transformer.wpe(pos)
            for i, block in enumerate(self.transformer.h):
                x = self._block(block, x)
                if self.twice and i == 0:
                    x = self._block(block, x)
            return self.lm_head(self.transformer.ln_f(x))


    class Headed(nn.Module):
        """An encoder of three units and a head only the first branch
        takes (BYOL's predictor, without its stop-gradient)."""

        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
            self.head = nn.Linear(8, 8)

        def forward(self, x, head=True):
            z = self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))
            return self.head(z) if head else z


def make_model(o):
    cfg = models.GPTConfig(layers=o.get("layers", 2))
    if o.get("model") == "llama":
        return models.llama()
    if o.get("model") == "head":
        return Headed()
    torch.manual_seed(cfg.seed)
    return VariantGPT(cfg, o.get("ckpt"), o.get("twice", False))


def batch(o, k, rank, world):
    if o.get("model") == "head":  # 8 features, ROWS rows per rank
        g = torch.Generator().manual_seed(100 + k)
        x = torch.randn(world * ROWS, 8, generator=g)
        return x[rank * ROWS:(rank + 1) * ROWS], None
    if o.get("model") == "llama":
        return models.gpt_batch(models.LlamaConfig(), k, rank, world, ROWS)
    return models.gpt_batch(models.GPTConfig(), k, rank, world, ROWS)


def loss_of(o, model, s, rank, world):
    """This rank's loss of step s over two forwards: the sum of two
    batches' losses, or (siamese) ||model(x1) - model(x2)||^2 plus the
    first batch's loss; forwards=3: three batches."""
    xs = [batch(o, s * 10 + i, rank, world) for i in range(o.get("forwards", 2))]
    if o.get("model") == "head":  # the second forward's first, without the head
        z2 = model(xs[1][0], head=False)
        return nn.functional.mse_loss(model(xs[0][0]), z2)
    if o.get("siamese"):
        z1, z2 = model(xs[0][0]), model(xs[1][0])
        ce = nn.functional.cross_entropy(z1.reshape(-1, z1.shape[-1]), xs[0][1].reshape(-1))
        return ce + nn.functional.mse_loss(z1, z2)
    return sum(models.gpt_loss(model, x, y) for x, y in xs)


def reference(o, world):
    """One process of torch on the ranks' mean gradient."""
    torch.set_num_threads(1)
    model = make_model(o)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, foreach=False, **HYPER)
    losses = []
    for s in range(STEPS):
        opt.zero_grad()
        total, grads = 0.0, None
        for r in range(world):
            for p in params:
                p.grad = None
            loss = loss_of(o, model, s, r, world)
            if o.get("retain"):
                loss.backward(retain_graph=True)
            loss.backward()
            total += loss.item()
            g = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        for p, g in zip(params, grads):
            p.grad = g / world
        opt.step()
        losses.append(total / world)
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}, losses


def rank_main(rank, world, sock, job, o, q):
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=world, transient_areas=True,
                               client_name="test_two_forwards rank %d" % rank)
        model = make_model(o)
        sm = shardd.nn.ShardedModule(client, model, auto_wrap=o.get("wrap", "children"),
                                     backward_prefetch=o.get("prefetch", "auto"))
        if o.get("daemon_optim"):
            opt = sm.register_optimizer("adamw", model.parameters(), **HYPER)
        else:
            opt = torch.optim.AdamW(model.parameters(), foreach=False, **HYPER)
        boom = [False]
        if o.get("raise"):
            def raising(m, i):
                if boom[0]:
                    raise RuntimeError("a forward that raises")
            model.transformer.h[1].mlp.register_forward_pre_hook(raising)
        losses = []
        for s in range(STEPS):
            (sm if o.get("daemon_optim") else opt).zero_grad()
            if o.get("raise"):
                # a forward, and a second one (its units on leaves) that
                # raises inside the second Block: nothing of it stays
                held = [model(batch(o, 99, rank, world)[0])]  # its graph alive
                boom[0] = True
                try:
                    model(batch(o, 98, rank, world)[0])
                except RuntimeError:
                    pass
                boom[0] = False
                held.clear()
            if o.get("no_sync"):
                # the first rank's half of the step's loss under no_sync(),
                # the second after it: a loss over two forwards each time
                with sm.no_sync():
                    half = loss_of(o, model, s, rank, world) * 0.5
                    half.backward()
                loss = loss_of(o, model, s, rank, world) * 0.5
                loss.backward()
                losses.append(half.item() + loss.item())
            else:
                loss = loss_of(o, model, s, rank, world)
                if o.get("retain"):  # each use's backward runs twice
                    loss.backward(retain_graph=True)
                loss.backward()
                losses.append(loss.item())
            if o.get("daemon_optim"):
                sm.step(opt)
            else:
                opt.step()
        full = sm.full_parameters()
        q.put(("out", rank, losses, {k: v.numpy().copy() for k, v in full.items()}
                                    if rank == 0 else None,
               sm.backward_prefetches, sm._leaf_uses))
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


def bf16_main(rank, world, sock, job, q):
    """A bf16 unit (fp32 master in the daemon, shardd.optim): two forwards
    before one backward, and the same losses' backward per forward (the
    second forward's first, as the first run reduces its uses), train
    alike but for bf16 rounding (the root unit sums its two uses' bf16
    gradients before reducing them in the first, not after)."""
    try:
        torch.set_num_threads(1)
        out = []
        for per_loss in (False, True):
            client = shardd.Client(sock, job="%s-%d" % (job, per_loss), rank=rank, world=world,
                                   transient_areas=True)
            model = make_model({})
            sm = shardd.nn.ShardedModule(client, model, auto_wrap={models.Block}, dtype="bf16")
            opt = sm.register_optimizer("adamw", model.parameters(), **HYPER)
            for s in range(STEPS):
                sm.zero_grad()
                (x1, y1), (x2, y2) = (batch({}, s * 10 + i, rank, world) for i in (0, 1))
                if per_loss:
                    models.gpt_loss(model, x2, y2).backward()
                    models.gpt_loss(model, x1, y1).backward()
                else:
                    (models.gpt_loss(model, x1, y1) + models.gpt_loss(model, x2, y2)).backward()
                sm.step(opt)
            out.append({k: v.float().numpy().copy() for k, v in sm.full_parameters().items()})
            client.close()
        q.put(("out", rank, (out, None)))
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


def uneven_main(rank, world, sock, job, layers, q):
    """Rank 0 runs two forwards before its backward, rank 1 one."""
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=world, transient_areas=True)
        model = make_model({"layers": layers})
        shardd.nn.ShardedModule(client, model, auto_wrap={models.Block})
        x, y = batch({}, 0, rank, world)
        err = None
        try:
            loss = models.gpt_loss(model, x, y)
            if rank == 0:
                loss = loss + models.gpt_loss(model, x, y)
            loss.backward()
        except shardd.Error as e:
            err = (e.code_name, e.message)
        q.put(("out", rank, err))
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


def hooked_main(rank, world, sock, job, q):
    """A gradient hook on a block's parameter, and two forwards."""
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=world, transient_areas=True)
        model = make_model({})
        shardd.nn.ShardedModule(client, model, auto_wrap={models.Block})
        model.transformer.h[1].mlp.c_fc.weight.register_hook(lambda g: g.clamp(-1, 1))
        x, y = batch({}, 0, rank, world)
        err = None
        try:
            loss = models.gpt_loss(model, x, y) + models.gpt_loss(model, x, y)
            loss.backward()
        except shardd.Error as e:
            err = (e.code_name, e.message)
        q.put(("out", rank, err))
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class TwoForwardsTest(unittest.TestCase):

    def check(self, **o):
        world = 2
        want, want_losses = reference(o, world)
        job, sock, out = common.job("twofw"), common.socket(), {}
        common.launch_ranks(rank_main, lambda r, q: (r, world, sock, job, o, q), world,
                            lambda m: out.__setitem__(m[1], m[2:]) if m[0] == "out" else None,
                            150)
        losses = [sum(out[r][0][i] for r in range(world)) / world for i in range(STEPS)]
        got = out[0][1]
        worst, at = tto.rel_diff({k: v.reshape(want[k].shape) for k, v in got.items()},
                                 want, key_bias=False)
        print("\n  %s: losses %s vs torch's %s, parameters %.3g (%s), backward prefetches %s"
              % (o, losses, want_losses, worst, at, [out[r][2] for r in range(world)]))
        np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
        self.assertLess(worst, TOL, at)
        # a forward after the first before one backward computes on leaves
        # of its own; one forward per backward never does (the last
        # step's graph, alive while the next forward runs, had its backward),
        # nor a reentrant checkpoint's (its forward runs under no_grad, and
        # each recomputation's backward is an inner one on the parameters)
        for r in range(world):
            if o.get("forwards", 2) > 1 and o.get("ckpt") is not True:
                self.assertGreater(out[r][3], 0, r)
            else:
                self.assertEqual(out[r][3], 0, r)
        return out

    def test_a_loss_over_two_batches_trains_as_torch(self):
        self.check(wrap={models.Block})

    def test_one_forward_per_backward_makes_no_leaves(self):
        self.check(wrap={models.Block}, forwards=1, twice=True)

    def test_a_head_only_one_forward_takes(self):
        """The second forward (computed first) skips the head: the head's
        one use is reduced before the encoder's second use is reached."""
        self.check(model="head")

    def test_a_siamese_loss_per_child_unit_trains_as_torch(self):
        self.check(siamese=True)

    def test_three_forwards_on_llama_trains_as_torch(self):
        self.check(model="llama", wrap={models.LlamaDecoderLayer}, forwards=3)

    def test_backward_prefetch_on_and_off(self):
        on = self.check(wrap={models.Block}, prefetch=True)
        self.assertTrue(all(on[r][2] > 0 for r in range(2)), "no backward prefetch")
        off = self.check(wrap={models.Block}, prefetch=False)
        self.assertTrue(all(off[r][2] == 0 for r in range(2)))

    def test_a_unit_used_twice_in_each_forward(self):
        self.check(wrap={models.Block}, twice=True)

    def test_reentrant_checkpointing(self):
        self.check(wrap={models.Block}, ckpt=True)

    def test_non_reentrant_checkpointing(self):
        self.check(wrap={models.Block}, ckpt=False)

    def test_reentrant_checkpointing_of_a_unit_used_twice(self):
        """Each recomputation's backward is an inner one of its own: the
        Block's two calls in a forward are two uses."""
        self.check(wrap={models.Block}, ckpt=True, twice=True)

    def test_non_reentrant_checkpointing_of_a_unit_used_twice(self):
        self.check(wrap={models.Block}, ckpt=False, twice=True, siamese=True)

    def test_a_forward_that_raised_inside_a_unit(self):
        self.check(wrap={models.Block}, **{"raise": True})

    def test_backward_twice_with_retain_graph(self):
        self.check(wrap={models.Block}, retain=True)

    def test_no_sync_with_two_forwards(self):
        self.check(wrap={models.Block}, no_sync=True)

    def test_shardd_optim_step(self):
        self.check(wrap={models.Block}, daemon_optim=True)

    def test_bf16_units_as_a_backward_per_forward(self):
        job, sock, out = common.job("twofw-bf16"), common.socket(), {}
        common.launch_ranks(bf16_main, lambda r, q: (r, 2, sock, job, q), 2,
                            lambda m: out.__setitem__(m[1], m[2]) if m[0] == "out" else None,
                            150)
        one, per = out[0][0]
        init = {k: v.detach().float().numpy() for k, v in make_model({}).named_parameters()}
        # per tensor: the runs' difference against how far the steps moved it
        worst, at = 0.0, None
        for k, b in per.items():
            if k.endswith("attn.c_attn.bias"):
                continue  # its key third's gradient is rounding (tto.rel_diff)
            d = float(np.linalg.norm(one[k] - b) / np.linalg.norm(b - init[k].reshape(b.shape)))
            if d > worst:
                worst, at = d, k
        print("\n  bf16: two forwards against a backward per forward: %.3g of the "
              "steps' change (%s)" % (worst, at))
        self.assertLess(worst, 0.1, at)

    @unittest.skipIf(common.UNDER_ASAN, common.ASAN_CXX_THROW)
    def test_ranks_with_different_numbers_of_forwards_are_refused(self):
        """Two blocks, and one: the ranks' next gathers or reduce-scatters
        differ, and the daemon fails them (no rank can go on), naming
        the cause."""
        for layers in (2, 1):
            self.uneven(layers)

    def uneven(self, layers):
        job, sock, out = common.job("twofw-uneven"), common.socket(), {}
        common.launch_ranks(uneven_main, lambda r, q: (r, 2, sock, job, layers, q), 2,
                            lambda m: out.__setitem__(m[1], m[2]) if m[0] == "out" else None,
                            120)
        for r in range(2):
            self.assertIsNotNone(out[r], "rank %d: uneven forwards went through" % r)
            self.assertEqual(out[r][0], "E_MISMATCH")
            self.assertIn("every rank must run as many forwards before each backward"
                          if "backward" in out[r][1].split(":")[0] else
                          "every rank must run the same forwards", out[r][1], r)
            print("\n  rank %d: %s: %s" % (r, out[r][0], out[r][1][:300]))

    @unittest.skipIf(common.UNDER_ASAN, common.ASAN_CXX_THROW)
    def test_a_parameter_hook_with_two_forwards_is_refused(self):
        job, sock, out = common.job("twofw-hook"), common.socket(), {}
        common.launch_ranks(hooked_main, lambda r, q: (r, 2, sock, job, q), 2,
                            lambda m: out.__setitem__(m[1], m[2]) if m[0] == "out" else None,
                            120)
        for r in range(2):
            self.assertIsNotNone(out[r], "rank %d: a hooked parameter's second use ran" % r)
            name, msg = out[r]
            self.assertEqual(name, "E_LIMIT")
            self.assertIn("'transformer.h.1.mlp.c_fc.weight'", msg)
            self.assertIn("register_hook", msg)


if __name__ == "__main__":
    unittest.main()
