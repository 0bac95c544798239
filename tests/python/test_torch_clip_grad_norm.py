"""torch's own clip_grad_norm_ over a wrapped model's parameters (the
habit of nanoGPT, HF's Trainer, Lightning: not sm.clip_grad_norm_)
clips by the global norm, as over the unwrapped model (transient areas,
2 ranks, nanoGPT with a unit per Block, against one process of torch on
the ranks' mean gradient). Outside forward each parameter is this rank's
1-D part of the shard and its .grad its part of the reduced gradient, so
torch's function took the norm of this rank's parts alone: every rank
clipped by another coefficient, 0.47 off torch's parameters after 3 SGD
steps, without an error. Here the parts' norms are all-reduced: called
as ``torch.nn.utils.clip_grad_norm_``, through a name bound before any
wrapper existed (this module's ``from torch.nn.utils import
clip_grad_norm_``, run by each rank's import of it), in the 2-, inf- and
3-norm, over a subset of the parameters; it returns the global norm on
every rank, raises torch's error on a NaN norm with error_if_nonfinite,
and refuses parameters no wrapper manages beside the wrapper's, naming
them."""
import unittest

import common
import shardd

if common.HAVE_TORCH:
    import torch
    from torch import nn
    from torch.nn.utils import clip_grad_norm_  # bound before any wrapper
    import models
    import shardd.nn

STEPS = 3
TOL = 1e-5
ROWS = 2  # per rank
MAX_NORM = 0.05  # below every step's norm: each step is clipped


def clip(how, model):
    if how == "attr":
        return torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    if how == "bound":
        return clip_grad_norm_(model.parameters(), MAX_NORM)
    if how == "inf":
        return clip_grad_norm_(model.parameters(), MAX_NORM / 20, norm_type="inf")
    # the 3-norm of the blocks' gradients only
    return clip_grad_norm_(model.transformer.h.parameters(), MAX_NORM / 2, norm_type=3)


def train(model, opt, how, ranks, world):
    """-> the norms clip returned."""
    norms = []
    for s in range(STEPS):
        opt.zero_grad()
        for r in ranks:  # the reference: each rank's share of the mean
            x, y = models.gpt_batch(models.GPTConfig(), s, r, world, rows=ROWS)
            (models.gpt_loss(model, x, y) / len(ranks)).backward()
        norms.append(float(clip(how, model)))
        opt.step()
    return norms


def rank_main(rank, world, sock, job, how, q):
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=world, transient_areas=True,
                               client_name="test_torch_clip_grad_norm rank %d" % rank)
        model = models.nano_gpt()
        sm = shardd.nn.ShardedModule(client, model, auto_wrap={models.Block})
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        q.put(("norms", rank, train(model, opt, how, [rank], world)))
        if how == "attr":
            errors = []
            # a NaN in rank 0's part: every rank's norm is NaN
            if rank == 0:
                model.lm_head.weight.grad[0] = float("nan")
            for norm_type in (2.0, "inf"):
                try:
                    clip_grad_norm_(model.parameters(), MAX_NORM, norm_type,
                                    error_if_nonfinite=True)
                    errors.append(None)
                except RuntimeError as e:
                    errors.append(str(e))
            opt.zero_grad()
            other = nn.Parameter(torch.ones(3))
            other.grad = torch.ones(3)
            try:
                clip_grad_norm_(list(model.parameters()) + [other], MAX_NORM)
            except RuntimeError as e:
                errors.append(str(e))
            q.put(("errors", rank, errors))
        common.send_params(rank, q, sm)
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class TorchClipGradNormTest(unittest.TestCase):

    def check(self, how, world=2):
        torch.set_num_threads(1)
        ref = models.nano_gpt()
        want = train(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), how,
                     range(world), world)
        job, sock = common.job("torchclip"), common.socket()
        got = common.launch_collect(rank_main, lambda r, q: (r, world, sock, job, how, q),
                                    world, timeout=120)
        for r in range(world):  # every rank's is the global norm
            for a, b in zip(got[("norms", r)], want):
                self.assertLessEqual(abs(a - b) / b, TOL, "%s: rank %d's norms %s, torch's %s"
                                     % (how, r, got[("norms", r)], want))
        for n, p in ref.named_parameters():
            d = common.max_rel(got["params"][n], p.detach().numpy())
            self.assertLessEqual(d, TOL, "%s: %s" % (how, n))
        return got

    def test_torch_clip_grad_norm_is_the_global_norm(self):
        got = self.check("attr")
        for r in range(2):
            nan, nan_inf, mixed = got[("errors", r)]
            self.assertIn("non-finite", nan or "")
            self.assertIn("non-finite", nan_inf or "")
            self.assertIn("no wrapper manages", mixed)
            self.assertIn("a tensor of shape (3,)", mixed)

    def test_a_name_bound_before_wrapping_is_the_global_norm(self):
        self.check("bound")

    def test_the_inf_norm(self):
        self.check("inf")

    def test_the_3_norm_of_some_parameters(self):
        self.check("p3")


if __name__ == "__main__":
    unittest.main()
