"""Transient areas: a write into a parameter in place from a forward hook
of the script's (WGAN's weight clipping as a forward pre-hook, under
no_grad or through .data) while its unit is gathered wrote the node's
read-only gathered copy, and the rank died of SIGSEGV. It is refused with
a RuntimeError naming the parameter and the hook, whether the hook was
registered before wrapping or after, pre-hook or forward hook; a hook
that only reads trains as torch (one that returns a new output computed
from the parameter too), a writing hook removed through its
handle before training is gone, and the same clipping between steps (after
the optimizer's step, over model.parameters()) trains as torch. 2 ranks
against one process of torch.optim on the global batch."""
import unittest

import common
import shardd

if common.HAVE_TORCH:
    import torch
    from torch import nn
    import shardd.nn

WORLD = 2
STEPS = 3
ROWS = 8
CLIP = 0.2
TOL = 1e-5


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def clip_hook(mod, inputs, *output):
    with torch.no_grad():
        mod.weight.clamp_(-CLIP, CLIP)


def clip_data_hook(mod, inputs):
    mod.weight.data.clamp_(-CLIP, CLIP)


def read_hook(mod, inputs):
    mod.seen = float(mod.weight.detach().abs().sum())


def penalty_hook(mod, inputs):
    # a term of the loss computed from the parameters in the hook: autograd
    # saves the parameter (its copy while the hook runs) for backward
    mod.penalty = mod.weight.pow(2).sum() * 0.1


def scale_hook(mod, inputs, output):
    # a new output computed from the module's parameter: autograd saves
    # the parameter (a forward hook registered after wrapping runs after
    # the unit's release, so reading it gathers the unit again, and its
    # copy is what the hook computes with)
    return output * mod.bias


def hook(model, case, wrapped):
    """Registers case's hook before wrapping (wrapped False) or after."""
    late = case.endswith("_after")
    if late != wrapped:
        return None
    if case.startswith("pre"):
        return model[2].register_forward_pre_hook(clip_hook)
    if case.startswith("data"):
        return model[2].register_forward_pre_hook(clip_data_hook)
    if case.startswith("post"):
        return model[2].register_forward_hook(clip_hook)
    if case == "reader":
        return model[2].register_forward_pre_hook(read_hook)
    if case == "penalty":
        return model[2].register_forward_pre_hook(penalty_hook)
    if case == "removed":
        return model[2].register_forward_pre_hook(clip_hook)
    if case == "scale_after":
        return model[2].register_forward_hook(scale_hook)
    return None


def data():
    g = torch.Generator().manual_seed(3)
    return torch.randn(STEPS, ROWS, 4, generator=g), torch.randn(STEPS, ROWS, 2, generator=g)


def train(model, opt, case, rows):
    x, y = data()
    for s in range(STEPS):
        opt.zero_grad()
        loss = sum(nn.functional.mse_loss(model(x[s, lo:hi]), y[s, lo:hi])
                   + (model[2].penalty if case == "penalty" else 0)
                   for lo, hi in rows) / len(rows)
        loss.backward()
        opt.step()
        if case == "between":  # WGAN's clipping: after the step
            with torch.no_grad():
                for p in model.parameters():
                    p.clamp_(-CLIP, CLIP)


def reference(case):
    model = make_model()
    if case in ("reader", "penalty", "between", "scale_after"):
        hook(model, case, case.endswith("_after"))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    per = ROWS // WORLD
    train(model, opt, case, [(r * per, (r + 1) * per) for r in range(WORLD)])
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def rank_main(rank, world, sock, job, case, q):
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=world, transient_areas=True)
        model = make_model()
        h = hook(model, case, False)
        sm = shardd.nn.ShardedModule(client, model, auto_wrap="children")
        h = hook(model, case, True) or h
        if case == "removed":
            h.remove()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        per = ROWS // world
        err = None
        try:
            train(model, opt, case, [(rank * per, (rank + 1) * per)])
        except RuntimeError as e:
            err = str(e)
        q.put(("out", rank, err))
        if err is None:
            common.send_params(rank, q, sm)
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


@unittest.skipUnless(common.HAVE_TORCH, "torch not installed")
class HookWrites(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        common.daemon()

    def run_case(self, case):
        sock, job = common.socket(), common.job("hookw-" + case)
        return common.launch_collect(rank_main, lambda r, q: (r, WORLD, sock, job, case, q), WORLD)

    def assert_refused(self, case, kind):
        got = self.run_case(case)
        for r in range(WORLD):
            err = got[("out", r)]
            self.assertIsNotNone(err, "rank %d trained without a word" % r)
            self.assertIn("'2.weight'", err)
            self.assertIn(kind, err)
            self.assertIn("between steps", err)

    def assert_trains_as_torch(self, case):
        got = self.run_case(case)
        for r in range(WORLD):
            self.assertIsNone(got[("out", r)])
        want = reference(case)
        for n in want:
            self.assertLessEqual(common.max_rel(got["params"][n], want[n]), TOL, n)

    def test_pre_hook_write_refused_by_name(self):
        for case in ("pre_before", "pre_after", "data_before"):
            with self.subTest(case=case):
                self.assert_refused(case, "forward pre-hook")

    def test_forward_hook_write_refused_by_name(self):
        self.assert_refused("post_after", "forward hook 'clip_hook'")

    def test_hook_that_reads_trains_as_torch(self):
        self.assert_trains_as_torch("reader")
        # what autograd saves of the copies is rebuilt from the unit's area
        self.assert_trains_as_torch("penalty")
        # a forward hook after the wrapper's whose new output is the
        # output times the parameter: backward reached it after the unit's
        # release, and computed with the parameter's part of the shard
        self.assert_trains_as_torch("scale_after")

    def test_removed_hook_is_gone(self):
        self.assert_trains_as_torch("removed")

    def test_clipping_between_steps_trains_as_torch(self):
        self.assert_trains_as_torch("between")


if __name__ == "__main__":
    unittest.main()
