"""Wholly frozen units above units a backward still reaches train as torch
(transient areas, 2 ranks, against one process of torch on the ranks' mean
gradient): fine-tuning the head and embeddings of nanoGPT with every Block
frozen (``model.transformer.h.requires_grad_(False)``, before or after
wrapping), or only its top Block frozen. Backward runs through a frozen
unit for its input's gradient and gathers it for its saved tensors; that
input is the output of the unit below, whose output hook starts its
backward with a gather on the same gradient, so the frozen unit is
released first (its hook put first on the tensor), else that gather found
the rank's 2 leases held by the root unit and the frozen one (E_LIMIT,
where torch trains)."""
import unittest

import common
import shardd

if common.HAVE_TORCH:
    import numpy as np
    import torch
    import models
    import shardd.nn

STEPS = 3
TOL = 1e-5
ROWS = 2  # per rank


def freeze(model, how):
    if how == "top":
        model.transformer.h[1].requires_grad_(False)
    else:  # "blocks": the head and the embeddings (tied) trained
        model.transformer.h.requires_grad_(False)


def train(model, opt, ranks, world):
    for s in range(STEPS):
        opt.zero_grad()
        for r in ranks:  # the reference: each rank's share of the mean
            x, y = models.gpt_batch(models.GPTConfig(), s, r, world, rows=ROWS)
            (models.gpt_loss(model, x, y) / len(ranks)).backward()
        opt.step()


def rank_main(rank, world, sock, job, how, after, q):
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=world, transient_areas=True,
                               client_name="test_frozen_units rank %d" % rank)
        model = models.nano_gpt()
        if not after:
            freeze(model, how)
        sm = shardd.nn.ShardedModule(client, model, auto_wrap={models.Block})
        if after:
            freeze(model, how)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        train(model, opt, [rank], world)
        common.send_params(rank, q, sm)
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class FrozenUnitsTest(unittest.TestCase):

    def check(self, how, after, world=2):
        torch.set_num_threads(1)
        ref = models.nano_gpt()
        freeze(ref, how)
        train(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9),
              range(world), world)
        job, sock = common.job("frozen"), common.socket()
        got = common.last_params(rank_main, lambda r, q: (r, world, sock, job, how, after, q),
                                 world, timeout=120)
        start = dict(models.nano_gpt().named_parameters())
        for n, p in ref.named_parameters():
            d = common.max_rel(got[n], p.detach().numpy())
            self.assertLessEqual(d, TOL, "%s (frozen %s, %s wrapping)" % (
                n, how, "after" if after else "before"))
            # the frozen ones unchanged, the others trained
            moved = not np.array_equal(got[n], start[n].detach().numpy())
            self.assertEqual(moved, p.requires_grad, n)

    def test_every_block_frozen_before_wrapping_head_and_embeddings_trained(self):
        self.check("blocks", after=False)

    def test_every_block_frozen_after_wrapping_head_and_embeddings_trained(self):
        self.check("blocks", after=True)

    def test_the_top_block_frozen_the_one_below_trained(self):
        self.check("top", after=False)


if __name__ == "__main__":
    unittest.main()
