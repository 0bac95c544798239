"""A torch.optim optimizer built before wrapping (nanoGPT's train.py builds
its AdamW before DDP's wrap) holds the original parameters, which the
wrapper replaced by views of the daemon's shards and emptied: they never
get a gradient, so torch's step would skip every one and the model would
not train, without a word. Its first step is refused instead, naming the
parameter and saying to build the optimizer after wrapping, before anything
changed; an optimizer built after wrapping, and one built before whose
group of originals is replaced (add_param_group of the wrapped ones after
the stale group is dropped) step as torch's. Likewise a module added to
the wrapped model after wrapping (``add_module``: nn.Sequential's forward
runs it): its parameters are none of the wrapper's, their gradient each
rank's own, never reduced, so a torch.optim step over them would step the
ranks apart; it is refused, naming them. Transient and resident clients, 2
ranks."""
import unittest

import common
import shardd

if common.HAVE_TORCH:
    import torch
    from torch import nn
    import shardd.nn


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))


def rank_main(rank, world, sock, job, transient, q):
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=world,
                               transient_areas=transient)
        model = make_model()
        early = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
        sm = shardd.nn.ShardedModule(client, model, auto_wrap="children")
        g = torch.Generator().manual_seed(rank)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
        early.zero_grad()
        if not transient:
            sm.gather()
        nn.functional.mse_loss(model(x), y).backward()
        if not transient:
            sm.scatter()
        before = {k: v.clone() for k, v in sm.full_parameters().items()}
        try:
            early.step()
            err = None
        except RuntimeError as e:
            err = str(e)
        after = sm.full_parameters()
        same = all(torch.equal(before[k], after[k]) for k in before)
        stepped = None
        if transient:
            # the stale group dropped, the wrapped parameters added: it steps
            early.param_groups.clear()
            early.state.clear()
            early.add_param_group({"params": list(model.parameters())})
            early.step()
            after = sm.full_parameters()
            stepped = any(not torch.equal(before[k], after[k]) for k in before)
        q.put(("out", rank, err, same, stepped))
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


def added_main(rank, world, sock, job, q):
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=world, transient_areas=True)
        model = make_model()
        shardd.nn.ShardedModule(client, model, auto_wrap="children")
        model.add_module("3", nn.Linear(8, 8))  # Sequential's forward runs it
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
        g = torch.Generator().manual_seed(rank)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        before = model[3].weight.detach().clone()
        try:
            opt.step()
            err = None
        except RuntimeError as e:
            err = str(e)
        q.put(("out", rank, err, torch.equal(before, model[3].weight.detach())))
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class OptimizerBeforeWrappingTest(unittest.TestCase):

    def test_a_module_added_after_wrapping_is_refused_at_the_step(self):
        job, sock, out = common.job("optadded"), common.socket(), {}
        common.launch_ranks(added_main, lambda r, q: (r, 2, sock, job, q), 2,
                            lambda m: out.__setitem__(m[1], m[2:]) if m[0] == "out" else None)
        for r in range(2):
            err, same = out[r]
            self.assertIsNotNone(err, r)
            self.assertIn("'3.weight', '3.bias'", err)
            self.assertIn("never reduced", err)
            self.assertTrue(same, r)

    def check(self, transient):
        job, sock, out = common.job("optbefore"), common.socket(), {}
        common.launch_ranks(rank_main, lambda r, q: (r, 2, sock, job, transient, q), 2,
                            lambda m: out.__setitem__(m[1], m[2:]) if m[0] == "out" else None)
        for r in range(2):
            err, same, stepped = out[r]
            label = "%s, rank %d" % ("transient" if transient else "resident", r)
            self.assertIsNotNone(err, label)
            self.assertIn("'0.weight'", err, label)
            self.assertIn("after wrapping", err, label)
            self.assertTrue(same, label)  # nothing changed
            if transient:
                self.assertTrue(stepped, label)

    def test_torch_optim_built_before_wrapping_is_refused_at_its_step_transient(self):
        self.check(True)

    def test_torch_optim_built_before_wrapping_is_refused_at_its_step_resident(self):
        self.check(False)


if __name__ == "__main__":
    unittest.main()
