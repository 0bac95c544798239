"""torch.optim optimizers over a wrapped model (transient areas, 2 ranks)
step each rank's 1-D part of every parameter (FSDP1's use_orig_params):
right for an optimizer that updates each element from that element alone,
wrong, without an error, for one that reads the whole parameter (a
LARS / LAMB trust ratio: the norm of the part, not of the parameter;
Adafactor's factored moments: the shape; LBFGS: dot products over all the
parameters). torch's element-wise ones (Adam with foreach=True, SGD with
nesterov and maximize, Rprop), a subclass that keeps its base's step and
an optimizer of the script's own marked with
shardd.nn.elementwise_optimizer train as torch on the whole model; the
others are refused at their first step, by name, with nothing changed.
The reference is one process of torch applying the mean of the ranks'
micro-batch gradients (test_torch_optim's)."""
import functools
import unittest

import common
import shardd

if common.HAVE_TORCH:
    import numpy as np
    import torch
    import models
    import shardd.nn
    import test_torch_optim as tto

STEPS = 4


if common.HAVE_TORCH:
    class LARS(torch.optim.Optimizer):
        """LARS as scripts copy it: SGD whose step of each parameter is
        scaled by the trust ratio ||p|| / ||grad|| of the WHOLE parameter."""

        def __init__(self, params, lr=0.1, momentum=0.9, eta=1e-3, weight_decay=1e-4):
            super().__init__(params, dict(lr=lr, momentum=momentum, eta=eta,
                                          weight_decay=weight_decay))

        @torch.no_grad()
        def step(self, closure=None):
            for g in self.param_groups:
                for p in g["params"]:
                    if p.grad is None:
                        continue
                    d = p.grad.add(p, alpha=g["weight_decay"])
                    pn, gn = torch.norm(p), torch.norm(d)
                    trust = torch.where((pn > 0) & (gn > 0), g["eta"] * pn / gn,
                                        torch.ones_like(pn))
                    buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                    buf.mul_(g["momentum"]).add_(d, alpha=float(trust) * g["lr"])
                    p.sub_(buf)

    class Adafactor(torch.optim.Optimizer):
        """Adafactor's factored second moment (row and column means) for a
        matrix, decided by p.dim() and p.shape."""

        def __init__(self, params, lr=1e-2, beta2=0.999, eps=1e-30):
            super().__init__(params, dict(lr=lr, beta2=beta2, eps=eps))

        @torch.no_grad()
        def step(self, closure=None):
            for g in self.param_groups:
                for p in g["params"]:
                    if p.grad is None:
                        continue
                    st, g2 = self.state[p], p.grad.pow(2) + g["eps"]
                    if p.dim() >= 2:
                        r = st.setdefault("row", torch.zeros(p.shape[0]))
                        c = st.setdefault("col", torch.zeros(p.shape[1]))
                        r.lerp_(g2.mean(dim=1), 1 - g["beta2"])
                        c.lerp_(g2.mean(dim=0), 1 - g["beta2"])
                        v = torch.outer(r, c) / r.mean()
                    else:
                        v = st.setdefault("v", torch.zeros_like(p))
                        v.lerp_(g2, 1 - g["beta2"])
                    p.addcdiv_(p.grad, v.sqrt(), value=-g["lr"])

    class SignSGD(torch.optim.Optimizer):
        """An element-wise optimizer of the script's own (marked as such)."""

        def __init__(self, params, lr=1e-3):
            super().__init__(params, dict(lr=lr))

        @torch.no_grad()
        def step(self, closure=None):
            for g in self.param_groups:
                for p in g["params"]:
                    if p.grad is not None:
                        p.add_(p.grad.sign(), alpha=-g["lr"])

    def centralized(step):
        """Gradient centralization as a decorator of a torch step (with
        functools.wraps, as decorators are written): each matrix's gradient
        less its rows' means first, which on a rank's 1-D part does
        nothing."""
        @functools.wraps(step)
        def centralized_step(self, closure=None):
            with torch.no_grad():
                for g in self.param_groups:
                    for p in g["params"]:
                        if p.grad is not None and p.grad.dim() > 1:
                            p.grad.sub_(p.grad.mean(dim=tuple(range(1, p.grad.dim())),
                                                    keepdim=True))
            return step(self, closure)
        return centralized_step

    class GCAdam(torch.optim.Adam):
        """Adam whose step is Adam's wrapped by a decorator that reads the
        whole parameter's shape."""
        step = centralized(torch.optim.Adam.step)

    class WarmAdamW(torch.optim.AdamW):
        """A subclass that changes defaults only: AdamW's own step."""

        def __init__(self, params):
            super().__init__(params, lr=3e-3, weight_decay=0.1, foreach=False)


def make_opt(kind, params):
    if kind == "adam_foreach":
        return torch.optim.Adam(params, lr=3e-3, foreach=True)
    if kind == "sgd_nesterov":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2)
    if kind == "sgd_maximize":
        return torch.optim.SGD(params, lr=0.01, momentum=0.5, maximize=True)
    if kind == "rprop":
        return torch.optim.Rprop(params, lr=1e-3)
    if kind in ("Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "ASGD"):
        return getattr(torch.optim, kind)(params, lr=1e-2)
    if kind == "RMSprop":
        return torch.optim.RMSprop(params, lr=1e-3, momentum=0.5, centered=True)
    if kind == "subclass":
        return WarmAdamW(params)
    if kind == "marked":
        return shardd.nn.elementwise_optimizer(SignSGD)(params)
    if kind == "gc_adam":
        return GCAdam(params, lr=3e-3)
    if kind == "lars":
        return LARS(params)
    if kind == "adafactor":
        return Adafactor(params)
    if kind == "lbfgs":
        return torch.optim.LBFGS(params, lr=0.1, max_iter=2)
    raise ValueError(kind)


def reference(kind, world):
    torch.set_num_threads(1)
    model = tto.make_model("gpt")
    opt = make_opt(kind, model.parameters())
    losses = []
    for s in range(STEPS):
        opt.zero_grad()
        losses.append(tto.backward("gpt", model, None, s, 0, world))
        opt.step()
    return losses, {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def rank_main(rank, world, sock, job, kind, q):
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=world, transient_areas=True,
                               client_name="test_optimizer_elementwise rank %d" % rank)
        model = tto.make_model("gpt")
        sm = shardd.nn.ShardedModule(client, model, auto_wrap={models.Block})
        opt = make_opt(kind, model.parameters())
        losses, err = [], None
        before = sm.full_parameters()
        for s in range(STEPS):
            opt.zero_grad()
            if kind == "lbfgs":
                def closure():
                    opt.zero_grad()
                    return torch.tensor(tto.backward("gpt", model, sm, s, rank, world))
                closure()
            else:
                losses.append(tto.backward("gpt", model, sm, s, rank, world))
            try:
                opt.step(closure) if kind == "lbfgs" else opt.step()
            except RuntimeError as e:
                err = str(e)
                break
        after = sm.full_parameters()
        same = all(torch.equal(before[k], after[k]) for k in before)
        sd = model.state_dict()
        q.put(("out", rank, losses, err, same,
               {k: v.detach().numpy().copy() for k, v in sd.items()} if rank == 0 else None))
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


def run(kind, world=2):
    job, sock, out = common.job("elemwise"), common.socket(), {}
    common.launch_ranks(rank_main, lambda r, q: (r, world, sock, job, kind, q), world,
                        lambda m: out.__setitem__(m[1], m[2:]) if m[0] == "out" else None, 150)
    return out


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class ElementwiseOptimizerTest(unittest.TestCase):

    def trains_as_torch(self, kind, world=2):
        want_losses, want = reference(kind, world)
        out = run(kind, world)
        for r in range(world):
            self.assertIsNone(out[r][1], "%s: rank %d" % (kind, r))
        losses = [sum(out[r][0][i] for r in range(world)) / world for i in range(STEPS)]
        rl = max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses))
        pr, at = tto.rel_diff(out[0][3], want)
        print("\n  %s, %d ranks: losses %.3g, parameters %.3g (%s)" % (kind, world, rl, pr, at))
        self.assertEqual(losses, want_losses, kind)
        for k, v in want.items():
            np.testing.assert_array_equal(out[0][3][k], v, err_msg="%s: %s" % (kind, k))

    def refused(self, kind, cls, world=2):
        out = run(kind, world)
        for r in range(world):
            losses, err, same, _ = out[r]
            self.assertIsNotNone(err, "%s: rank %d stepped without an error" % (kind, r))
            self.assertIn("%s steps " % cls, err)
            self.assertIn("'transformer.wte.weight'", err)
            self.assertIn("shardd.nn.elementwise_optimizer", err)
            self.assertTrue(same, "%s: rank %d: the step changed parameters" % (kind, r))
            self.assertLessEqual(len(losses), 1)  # at its first step

    def test_adam_foreach_trains_as_torch(self):
        self.trains_as_torch("adam_foreach")

    def test_sgd_nesterov_and_maximize_train_as_torch(self):
        self.trains_as_torch("sgd_nesterov")
        self.trains_as_torch("sgd_maximize")

    def test_rprop_trains_as_torch(self):
        self.trains_as_torch("rprop")

    def test_the_other_elementwise_torch_optimizers_train_as_torch(self):
        for kind in ("Adagrad", "Adadelta", "Adamax", "RMSprop", "NAdam", "RAdam", "ASGD"):
            self.trains_as_torch(kind)

    def test_a_subclass_keeping_adamws_step_trains_as_torch(self):
        self.trains_as_torch("subclass")

    def test_an_optimizer_marked_elementwise_trains_as_torch(self):
        self.trains_as_torch("marked")

    def test_a_lars_trust_ratio_is_refused_at_the_first_step(self):
        """The trust ratio of a rank's part is not the parameter's: without
        the refusal the ranks step other values than torch, silently."""
        self.refused("lars", "LARS")

    def test_a_factored_second_moment_is_refused_at_the_first_step(self):
        self.refused("adafactor", "Adafactor")

    def test_an_elementwise_step_wrapped_by_a_decorator_is_refused(self):
        """A subclass whose step is Adam's inside a decorator of its own
        (functools.wraps makes it look like Adam's step) may read the whole
        parameter before Adam's step: refused unless marked."""
        self.refused("gc_adam", "GCAdam")

    def test_lbfgs_is_refused_at_the_first_step(self):
        self.refused("lbfgs", "LBFGS")


if __name__ == "__main__":
    unittest.main()
