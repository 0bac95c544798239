"""Copies of a wrapped model (transient areas, 2 ranks, nanoGPT with a
unit per Block): an EMA model deep-copied before wrapping and updated from
``model.state_dict()`` after each step (timm's ModelEmaV2: every parameter
whole on every rank) holds torch's EMA; ``copy.deepcopy(model)`` and
``torch.save(model)`` after wrapping are refused by name (they reached the
wrapper through its hooks and failed inside the client: "ctypes objects
containing pointers cannot be pickled", naming neither the model nor a
way out)."""
import copy
import io
import unittest

import common
import shardd

if common.HAVE_TORCH:
    import torch
    import models
    import shardd.nn

STEPS = 3
TOL = 1e-5
ROWS = 2  # per rank
DECAY = 0.9


def train(model, ema, opt, ranks, world):
    for s in range(STEPS):
        opt.zero_grad()
        for r in ranks:  # the reference: each rank's share of the mean
            x, y = models.gpt_batch(models.GPTConfig(), s, r, world, rows=ROWS)
            (models.gpt_loss(model, x, y) / len(ranks)).backward()
        opt.step()
        with torch.no_grad():  # ModelEmaV2's update
            for e, m in zip(ema.state_dict().values(), model.state_dict().values()):
                e.mul_(DECAY).add_(m, alpha=1 - DECAY)


def rank_main(rank, world, sock, job, q):
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=world, transient_areas=True,
                               client_name="test_copy_of_wrapped rank %d" % rank)
        model = models.nano_gpt()
        ema = copy.deepcopy(model)  # before wrapping
        shardd.nn.ShardedModule(client, model, auto_wrap={models.Block})
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        train(model, ema, opt, [rank], world)
        errors = []
        for copy_it in (copy.deepcopy, lambda m: torch.save(m, io.BytesIO())):
            try:
                copy_it(model)
                errors.append(None)
            except TypeError as e:
                errors.append(str(e))
        q.put(("errors", rank, errors))
        if rank == 0:
            q.put(("params", {n: p.detach().numpy().copy() for n, p in ema.named_parameters()}))
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class CopyOfWrappedTest(unittest.TestCase):

    def test_ema_copied_before_wrapping_and_copies_after_refused(self):
        torch.set_num_threads(1)
        world = 2
        ref = models.nano_gpt()
        ref_ema = copy.deepcopy(ref)
        train(ref, ref_ema, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9),
              range(world), world)
        job, sock = common.job("copywrapped"), common.socket()
        got = common.launch_collect(rank_main, lambda r, q: (r, world, sock, job, q),
                                    world, timeout=120)
        for n, p in ref_ema.named_parameters():
            self.assertLessEqual(common.max_rel(got["params"][n], p.detach().numpy()), TOL, n)
        for r in range(world):
            deep, saved = got[("errors", r)]
            self.assertIn("copy.deepcopy of a model wrapped by shardd.nn.ShardedModule", deep or "")
            self.assertIn("Copy the model before wrapping", deep)
            self.assertIn("torch.save(model)", saved or "")
            self.assertIn("model.state_dict()", saved)


if __name__ == "__main__":
    unittest.main()
