"""A hook on a parameter's AccumulateGrad node
(``p.expand_as(p).grad_fn.next_functions[0][0].register_hook``, torch
1.13's post-accumulate-grad hook) on nanoGPT with a unit per Block, 2
ranks, transient areas. Made before wrapping it was on the replaced
parameter and never ran, with no error: refused at wrapping, naming the
parameter (a pre-hook too). Made after wrapping, before the first
forward (while the parameter is its 1-D part) the backward failed on a
shape: refused at the unit's first gather. Made after a step it would
see this rank's unreduced gradient or the reduced part, depending on
the order: the backward is refused before it runs, and once it is
removed the next step trains (the refused backward left no area
held)."""
import unittest

import common
import shardd

if common.HAVE_TORCH:
    import torch
    import models
    import shardd.nn


def node_of(p):
    return p.expand_as(p).grad_fn.next_functions[0][0]


def rank_main(rank, world, sock, job, when, q):
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=world, transient_areas=True)
        model = models.nano_gpt()
        seen = []
        keep = []  # the nodes, alive as the script keeps them

        def post(grad_inputs, grad_outputs):
            seen.append(1)

        def hook(p):
            node = node_of(p)
            keep.append(node)
            return (node.register_prehook(lambda g: seen.append(1)) if when == "pre"
                    else node.register_hook(post))

        x, y = models.gpt_batch(models.GPTConfig(), 0, rank, world)
        err, handle = None, None
        try:
            if when in ("before", "pre"):
                handle = hook(model.transformer.h[1].mlp.c_fc.weight)
            sm = shardd.nn.ShardedModule(client, model, auto_wrap={models.Block})
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            if when == "after_step":
                models.gpt_loss(model, x, y).backward()
                opt.step()
                opt.zero_grad()
            if when in ("after", "after_step"):
                handle = hook(model.transformer.h[1].mlp.c_fc.weight)
            models.gpt_loss(model, x, y).backward()
        except shardd.Error as e:
            err = (e.code_name, e.message)
        after = None
        if when == "after_step" and err is not None:
            # removed, the loop goes on: the refused backward held nothing
            handle.remove()
            opt.zero_grad()
            loss = models.gpt_loss(model, x, y)
            loss.backward()
            opt.step()
            after = float(loss)
        q.put(("out", rank, (err, len(seen), after)))
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
@unittest.skipIf(common.UNDER_ASAN, common.ASAN_CXX_THROW)
class AccumulateGradHooksTest(unittest.TestCase):

    def refused(self, when, says):
        job, sock = common.job("acchook-" + when), common.socket()
        got = common.launch_collect(rank_main, lambda r, q: (r, 2, sock, job, when, q), 2, 120)
        for r in range(2):
            err, seen, after = got[("out", r)]
            self.assertIsNotNone(err, "rank %d: the hooked backward went through" % r)
            print("\n  %s, rank %d: %s: %s" % (when, r, err[0], err[1][:200]))
            self.assertEqual(err[0], "E_STATE")
            self.assertIn("'transformer.h.1.mlp.c_fc.weight'", err[1])
            self.assertIn("AccumulateGrad", err[1])
            self.assertIn(says, err[1])
            self.assertEqual(seen, 0, "the script's hook ran")
        return got

    def test_a_hook_made_before_wrapping_is_refused_at_wrapping(self):
        self.refused("before", "made before wrapping")

    def test_a_pre_hook_made_before_wrapping_is_refused_at_wrapping(self):
        self.refused("pre", "made before wrapping")

    def test_a_hook_made_after_wrapping_is_refused_at_the_first_gather(self):
        self.refused("after", "made after wrapping")

    def test_a_hook_made_after_a_step_is_refused_in_backward(self):
        got = self.refused("after_step", "made after wrapping")
        for r in range(2):
            self.assertIsNotNone(got[("out", r)][2], r)


if __name__ == "__main__":
    unittest.main()
