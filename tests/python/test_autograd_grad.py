"""torch.autograd.grad(loss, model.parameters()) over a model wrapped per
block (transient areas, 2 ranks) accumulates no .grad, so no unit's
gradient is ever whole and the units wait holding their areas: the next
unit's gather is refused (E_LIMIT), and the message names
torch.autograd.grad and backward() as the way, not only the other causes
of a late gradient."""
import unittest

import common
import shardd

if common.HAVE_TORCH:
    import torch
    import models
    import shardd.nn


def rank_main(rank, world, sock, job, q):
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=world, transient_areas=True)
        model = models.nano_gpt()
        shardd.nn.ShardedModule(client, model, auto_wrap={models.Block})
        x, y = models.gpt_batch(models.GPTConfig(), 0, rank, world)
        loss = models.gpt_loss(model, x, y)
        try:
            torch.autograd.grad(loss, list(model.parameters()))
            err = None
        except shardd.Error as e:
            err = (e.code_name, e.message)
        q.put(("out", rank, err))
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class AutogradGradTest(unittest.TestCase):

    @unittest.skipIf(common.UNDER_ASAN, common.ASAN_CXX_THROW)
    def test_autograd_grad_over_a_wrapped_model_is_refused_naming_it(self):
        job, sock, out = common.job("agrad"), common.socket(), {}
        common.launch_ranks(rank_main, lambda r, q: (r, 2, sock, job, q), 2,
                            lambda m: out.__setitem__(m[1], m[2]) if m[0] == "out" else None)
        for r in range(2):
            self.assertIsNotNone(out[r], r)
            name, msg = out[r]
            self.assertEqual(name, "E_LIMIT")
            self.assertIn("torch.autograd.grad()", msg)
            self.assertIn("loss.backward()", msg)


if __name__ == "__main__":
    unittest.main()
