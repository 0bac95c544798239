"""A mixture-of-experts layer through shardd.nn's transient areas: an expert
no token is routed to on one rank only (its parameters get a gradient on
some ranks, not on others) inside a unit of several, against one process of
plain torch.optim on the global batch.

Every rank must send the same gathers and scatters in the same order: the
unit holding the experts must be reduced at the same point of the backward
on every rank, whichever of its parameters this rank's tokens reached."""
import unittest

import common
import shardd

if common.HAVE_TORCH:
    import numpy as np
    import torch
    from torch import nn
    import shardd.nn

STEPS = 6
BATCH = 16
D = 8
EXPERTS = 3
BLOCKS = 3
TOL = 1e-5  # as test_torch_optim's: per tensor max|a-b| / max|b|
HYPER = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


if common.HAVE_TORCH:
    class Expert(nn.Linear):
        """An expert (a class of its own, for auto_wrap)."""

    class MoE(nn.Module):
        """Top-1 routing given with the data (a hash router's choice): the
        router's softmax weighs each token's expert. An expert no token is
        routed to is, by mode: "skip", not called (as MoE layers do);
        "empty", called on the empty selection, its output added (a zero
        gradient); "unused", called on the empty selection, its output not
        used (no gradient at all)."""

        def __init__(self, mode):
            super().__init__()
            self.mode = mode
            self.router = nn.Linear(D, EXPERTS)
            self.experts = nn.ModuleList(Expert(D, D) for _ in range(EXPERTS))

        def forward(self, x, route):
            gate = torch.softmax(self.router(x), -1).gather(1, route[:, None])
            out = torch.zeros_like(x)
            for e, expert in enumerate(self.experts):
                sel = (route == e).nonzero().squeeze(1)
                if sel.numel() == 0 and self.mode == "skip":
                    continue
                y = expert(x[sel])
                if sel.numel() == 0 and self.mode == "unused":
                    continue
                out = out.index_add(0, sel, gate[sel] * y)
            return out

    class Block(nn.Module):
        def __init__(self, mode):
            super().__init__()
            self.moe = MoE(mode)
            self.mlp = nn.Linear(D, D)

        def forward(self, x, route):
            x = x + self.moe(torch.tanh(x), route)
            return x + self.mlp(torch.tanh(x))

    class Model(nn.Module):
        def __init__(self, mode):
            super().__init__()
            self.inp = nn.Linear(D, D)
            self.blocks = nn.ModuleList(Block(mode) for _ in range(BLOCKS))
            self.head = nn.Linear(D, 4)

        def forward(self, x, route):
            x = self.inp(x)
            for b in self.blocks:
                x = b(x, route)
            return self.head(x)


def model(mode):
    torch.manual_seed(0)
    return Model(mode)


def make_data(world):
    """Inputs, targets and each token's expert. Rank 1's slice routes no
    token to expert 1 at the odd steps and none to expert 2 at step 2;
    rank 0's slice reaches every expert, except at step 4 where no rank's
    reaches expert 0 (skipped by every rank, and by torch's step)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(STEPS, BATCH, D, generator=g)
    y = torch.randn(STEPS, BATCH, 4, generator=g)
    route = torch.arange(BATCH).remainder(EXPERTS).repeat(STEPS, 1)
    per = BATCH // world
    for s in range(STEPS):
        r1 = route[s, per:2 * per]
        if s % 2:
            r1[r1 == 1] = 0
        if s == 2:
            r1[r1 == 2] = 1
        if s == 4:
            route[s][route[s] == 0] = 2
    return x, y, route


def reference(world, mode):
    torch.set_num_threads(1)
    m = model(mode)
    x, y, route = make_data(world)
    opt = torch.optim.AdamW(m.parameters(), foreach=False, **HYPER)
    per = BATCH // world
    for s in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = sum(nn.functional.mse_loss(m(x[s, r * per:(r + 1) * per],
                                            route[s, r * per:(r + 1) * per]),
                                          y[s, r * per:(r + 1) * per])
                   for r in range(world)) / world
        loss.backward()
        opt.step()
    return {n: p.detach().numpy().copy() for n, p in m.named_parameters()}


def rank_main(rank, world, sock, job, wrap, mode, q):
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=world, transient_areas=True,
                               client_name="test_moe_routing rank %d" % rank)
        m = model(mode)
        x, y, route = make_data(world)
        per = BATCH // world
        lo, hi = rank * per, (rank + 1) * per
        # (an expert's unit nested in a Block's would need 3 gather areas)
        auto_wrap = {"block": {Block}, "expert": {Expert}}[wrap.split("+")[0]]
        sm = shardd.nn.ShardedModule(client, m, auto_wrap=auto_wrap)
        opt = torch.optim.AdamW(m.parameters(), foreach=False, **HYPER)
        for s in range(STEPS):
            if wrap.endswith("+eval"):  # an evaluation with grad enabled, no backward
                m.eval()
                m(x[s, lo:hi], route[s, lo:hi])
                m.train()
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(m(x[s, lo:hi], route[s, lo:hi]), y[s, lo:hi])
            loss.backward()
            opt.step()
        common.send_params(rank, q, sm)
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


def run(world, wrap, mode, timeout=60):
    job, sock = common.job("moe"), common.socket()
    return common.last_params(rank_main, lambda r, q: (r, world, sock, job, wrap, mode, q),
                              world, timeout)


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class MoERoutingTest(unittest.TestCase):
    def check(self, wrap, mode):
        got = run(2, wrap, mode)
        want = reference(2, mode)
        self.assertEqual(sorted(got), sorted(want))
        worst = max(common.max_rel(got[n], want[n]) for n in want)
        print("\n  %s units, %s: parameters max rel %.3g" % (wrap, mode, worst))
        for n in want:
            self.assertLessEqual(common.max_rel(got[n], want[n]), TOL, "%s %s: %s" % (wrap, mode, n))
        init = dict(model(mode).named_parameters())
        # rank 1 never reached expert 1 at odd steps: stepped all the same
        n = "blocks.0.moe.experts.1.weight"
        self.assertFalse(np.array_equal(got[n], init[n].detach().numpy()), n)

    def test_an_expert_unrouted_on_one_rank_inside_a_block_unit(self):
        """The experts are parameters of the Block's unit: some of them get
        no gradient on rank 1 only (not called, or their output unused)."""
        self.check("block", "skip")
        self.check("block", "unused")

    def test_an_evaluation_forward_before_each_step_changes_nothing(self):
        """An eval-mode forward with grad enabled and no backward before
        each training forward: its uses of the units are not waited for."""
        self.check("block+eval", "skip")

    def test_each_expert_a_unit_called_on_every_rank(self):
        """Each expert a unit of its own, called on every rank (a gather
        in forward is a collective), on an empty selection where no token
        of the rank's is routed to it: a zero gradient there."""
        self.check("expert", "empty")

    @unittest.skipIf(common.UNDER_ASAN, common.ASAN_CXX_THROW)
    @unittest.expectedFailure
    def test_an_expert_unit_whose_output_reaches_the_loss_on_one_rank_only(self):
        """Not supported yet (FSDP hangs there too): an expert's unit
        whose output the loss does not depend on on rank 1 has no backward
        there, so rank 1 never sends the gather that rank 0's backward of
        it sends. The daemon refuses the mismatch after --peer-grace
        (see the next test); torch would step it."""
        self.check("expert", "unused")

    @unittest.skipIf(common.UNDER_ASAN, common.ASAN_CXX_THROW)
    def test_an_expert_unit_used_on_one_rank_only_is_refused_naming_it(self):
        with self.assertRaises(RuntimeError) as cm:
            run(2, "expert", "unused")
        msg = str(cm.exception)
        self.assertIn("E_MISMATCH", msg)
        # the last block's backward comes first: rank 0 gathers expert 1
        # there, rank 1 expert 0 (the unit each rank's refusal names)
        self.assertRegex(msg, r"unit 'blocks\.2\.moe\.experts\.[01]''s backward")
        self.assertIn('"blocks.2.moe.experts.1.flat_param"', msg)
        self.assertIn('"blocks.2.moe.experts.0.flat_param"', msg)
        self.assertIn("every rank's loss must depend on the outputs of the same units", msg)


if __name__ == "__main__":
    unittest.main()
