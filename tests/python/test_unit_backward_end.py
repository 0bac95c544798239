"""When a transient non-root unit's backward ends (its scatter): once the
gradient of its forward's inputs is whole, or once every parameter has its
gradient. Each case is a unit whose forward uses its parameters in a way
where those two points could differ -- a unit called twice, the same tensor
or views of one passed twice, a parameter on a branch the input does not
reach (a second output used later, an index from argmax, torch.no_grad), an
in-place op on the input or a detached one (whose gradient never comes: the
unit must not hold its areas to the end of backward), activation
checkpointing around each call (reentrant: recomputed in backward) -- two
ranks against one process of torch.optim on the global batch: a unit
reduced before a parameter's gradient is whole trains wrong silently."""
import unittest

import common
import shardd

if common.HAVE_TORCH:
    import torch
    import torch.utils.checkpoint
    from torch import nn
    import shardd.nn

STEPS = 3
BATCH = 8
D = 6
TOL = 1e-5  # as test_torch_optim's: per tensor max|a-b| / max|b|
HYPER = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


if common.HAVE_TORCH:
    class Blk(nn.Module):
        """The unit (auto_wrap={Blk}); `case` picks how its forward uses
        its parameters."""

        def __init__(self, case):
            super().__init__()
            self.case = case
            self.lin = nn.Linear(D, D)
            self.lin2 = nn.Linear(D, D)
            self.emb = nn.Embedding(D, D)
            self.extra = nn.Parameter(torch.linspace(-1, 1, D))

        def forward(self, a, b=None, mem=None):
            c = self.case
            rest = self.lin2.weight.sum(0) + self.lin2.bias + self.emb.weight.sum(0)
            if c == "pair":  # a and b: one tensor twice, or views of one
                return self.lin(a) * torch.tanh(self.lin2(b))
            if c == "branch":  # a second output from the parameters alone
                return torch.tanh(self.lin(a)), self.extra * 2 + self.lin2.bias
            if c == "argmax":  # a parameter after a non-differentiable op
                return self.lin(a) + self.emb(a.argmax(-1)) * self.extra
            if c == "no_grad":  # part of the parameters under no_grad
                with torch.no_grad():
                    s = self.lin2(a)
                return self.lin(a) * s
            if c == "inplace":  # an in-place op on the input itself
                a.mul_(2)
                return torch.tanh(self.lin(a)) + self.extra + rest
            if c == "detach":  # no gradient reaches the input (a stop-gradient)
                return torch.tanh(self.lin(a.detach())) + self.extra + rest
            if c == "kwargs":  # an input given by keyword (not hooked)
                return self.lin(a) + self.lin2(mem) * self.extra
            if c == "unused":  # emb gets no gradient
                return torch.tanh(self.lin2(torch.tanh(self.lin(a)))) + self.extra
            return (torch.tanh(self.lin2(torch.tanh(self.lin(a)))) + self.extra
                    + self.emb.weight.sum(0))

    class Model(nn.Module):
        def __init__(self, case):
            super().__init__()
            self.case = case
            self.inp = nn.Linear(D, D)
            self.blk = Blk(case.split("+")[0])
            self.other = Blk("plain")
            self.first = Blk("plain")
            self.head = nn.Linear(D, 2)

        def call(self, *a, **kw):
            if "ckpt" in self.case.split("+"):
                return torch.utils.checkpoint.checkpoint(self.blk, *a, use_reentrant=True, **kw)
            if "ckpt_nr" in self.case.split("+"):
                return torch.utils.checkpoint.checkpoint(self.blk, *a, use_reentrant=False,
                                                         **kw)
            return self.blk(*a, **kw)

        def forward(self, x):
            c = self.case.split("+")[0]
            h = self.first(self.inp(x))
            if "twice" in self.case.split("+"):
                h = self.call(self.call(h))
            elif c == "pair":
                h = self.call(h, h)
            elif c == "pair_views":
                h = self.call(h[:, :], h.view(h.shape[0], D))
            elif c == "branch":
                h, q = self.call(h)
                h = self.other(h) * q
            elif c == "detach":  # the unit beside the path to the loss
                h = h + self.call(h)
            elif c == "kwargs":
                h = self.call(h, mem=torch.tanh(h) * 3)
            else:
                h = self.call(h)
            return self.head(self.other(h))


def model(case):
    torch.manual_seed(0)
    m = Model(case)
    if case.startswith("pair_views"):
        m.blk.case = "pair"
    return m


def make_data():
    g = torch.Generator().manual_seed(7)
    return torch.randn(STEPS, BATCH, D, generator=g), torch.randn(STEPS, BATCH, 2, generator=g)


def reference(world, case):
    torch.set_num_threads(1)
    m = model(case)
    x, y = make_data()
    opt = torch.optim.AdamW(m.parameters(), foreach=False, **HYPER)
    per = BATCH // world
    for s in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = sum(nn.functional.mse_loss(m(x[s, r * per:(r + 1) * per]),
                                          y[s, r * per:(r + 1) * per])
                   for r in range(world)) / world
        loss.backward()
        opt.step()
    return {n: p.detach().numpy().copy() for n, p in m.named_parameters()}


def rank_main(rank, world, sock, job, case, q):
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=world, transient_areas=True,
                               client_name="test_unit_backward_end rank %d" % rank)
        m = model(case)
        x, y = make_data()
        per = BATCH // world
        lo, hi = rank * per, (rank + 1) * per
        sm = shardd.nn.ShardedModule(client, m, auto_wrap={Blk})
        opt = torch.optim.AdamW(m.parameters(), foreach=False, **HYPER)
        for s in range(STEPS):
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(m(x[s, lo:hi]), y[s, lo:hi])
            loss.backward()
            opt.step()
        common.send_params(rank, q, sm)
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


def run(world, case, timeout=60):
    job, sock = common.job("ube"), common.socket()
    return common.last_params(rank_main, lambda r, q: (r, world, sock, job, case, q),
                              world, timeout)


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class UnitBackwardEndTest(unittest.TestCase):
    def check(self, *cases):
        for case in cases:
            with self.subTest(case=case):
                got = run(2, case)
                want = reference(2, case)
                self.assertEqual(sorted(got), sorted(want))
                worst = max(common.max_rel(got[n], want[n]) for n in want)
                print("\n  %s: parameters max rel %.3g" % (case, worst))
                for n in want:
                    self.assertLessEqual(common.max_rel(got[n], want[n]), TOL, "%s: %s" % (case, n))

    def test_a_unit_called_twice(self):
        self.check("plain+twice", "unused+twice")

    def test_one_tensor_or_views_of_it_passed_twice(self):
        self.check("pair", "pair_views")

    def test_a_parameter_the_input_does_not_reach(self):
        self.check("branch", "argmax", "no_grad", "kwargs")

    def test_no_gradient_reaches_the_input(self):
        self.check("detach")

    def test_an_in_place_op_on_the_input(self):
        self.check("inplace")

    def test_activation_checkpointing_around_each_call(self):
        # twice, each call in its own reentrant checkpoint: each nested
        # backward ends the unit, the second adds its share (it failed with
        # a size error: the second recomputation's gradient accumulated
        # into the 1-D .grad the first one's scatter left)
        self.check("plain+ckpt", "plain+ckpt_nr", "unused+ckpt", "unused+ckpt_nr",
                   "plain+twice+ckpt_nr", "unused+twice+ckpt_nr",
                   "plain+twice+ckpt", "unused+twice+ckpt")


if __name__ == "__main__":
    unittest.main()
