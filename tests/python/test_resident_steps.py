"""A resident client's steps gather the units they changed, and the next
``sm.gather()`` sends nothing: loops where that skip could leave the
parameters behind the shards train as one process of plain torch
(nanoGPT per Block with tied embeddings, 2 ranks), the parameters read
right after each step (an EMA's or a log line's read) as torch's:

* two optimizers over different units (the Blocks; the embeddings, tied
  head and final norm), both stepped;
* a step of one of them skipped on some iterations (as GradScaler skips
  one on every rank), gradients then adding up as torch's;
* the loop without ``gather()`` (a forward right after the steps);
* ``model.load_state_dict()`` between steps (the values of an earlier
  step loaded back), then the loop without ``gather()`` again."""
import unittest

import common
import shardd

if common.HAVE_TORCH:
    import torch
    import models
    import shardd.nn
    import shardd.optim

WORLD = 2
ROWS = 2
STEPS = 4
TOL = 1e-5
HYPER = dict(lr=0.1, momentum=0.9)


def _split(model):
    """The Blocks' parameters, and the others (embeddings, the tied head,
    the final norm)."""
    blocks = {id(p) for b in model.transformer.h for p in b.parameters()}
    return ([p for p in model.parameters() if id(p) in blocks],
            [p for p in model.parameters() if id(p) not in blocks])


def _skipped(case, s):
    """Which optimizer (0 the Blocks', 1 the others') skips step s."""
    if case in ("skip", "skip_no_gather"):
        return {1: 1, 2: 0}.get(s)
    return None


def _reads(model):
    """What a script reads of the parameters after a step (an EMA's
    copy, a norm for a log line)."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def reference(case):
    """Plain torch, one process, the whole batch: (losses, reads per step)."""
    cfg = models.GPTConfig()
    model = models.nano_gpt(cfg)
    opts = [torch.optim.SGD(ps, **HYPER) for ps in _split(model)]
    losses, reads, saved = [], [], None
    for s in range(STEPS):
        for o in opts:
            o.zero_grad()
        x, y = models.gpt_batch(cfg, s, 0, 1, rows=WORLD * ROWS)
        loss = models.gpt_loss(model, x, y)
        loss.backward()
        for i, o in enumerate(opts):
            if _skipped(case, s) != i:
                o.step()
        losses.append(loss.item())
        reads.append(_reads(model))
        if case == "load" and s == 0:
            saved = {k: v.clone() for k, v in model.state_dict().items()}
        if case == "load" and s == 2:
            model.load_state_dict(saved)
            reads[-1] = _reads(model)
    return losses, reads


def rank_main(rank, world, sock, job, case, q):
    try:
        torch.set_num_threads(1)
        cfg = models.GPTConfig()
        client = shardd.Client(sock, job=job, rank=rank, world=world, transient_areas=False)
        model = models.nano_gpt(cfg)
        sm = shardd.nn.ShardedModule(client, model, auto_wrap={models.Block})
        opts = [shardd.optim.SGD(ps, **HYPER) for ps in _split(model)]
        gather = case in ("two_optims", "skip")
        losses, reads, saved = [], [], None
        for s in range(STEPS):
            if gather:
                sm.gather()
            for o in opts:
                o.zero_grad()
            x, y = models.gpt_batch(cfg, s, rank, world, rows=ROWS)
            loss = models.gpt_loss(model, x, y)
            loss.backward()
            sm.scatter("mean")
            for i, o in enumerate(opts):
                if _skipped(case, s) != i:
                    o.step()
            losses.append(loss.item())
            reads.append({n: t.numpy().copy() for n, t in _reads(model).items()})
            if case == "load" and s == 0:
                saved = {k: v.clone() for k, v in model.state_dict().items()}
            if case == "load" and s == 2:
                model.load_state_dict(saved)
                reads[-1] = {n: t.numpy().copy() for n, t in _reads(model).items()}
        q.put(("out", rank, losses, reads))
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


@unittest.skipUnless(common.HAVE_TORCH, "torch not installed")
class ResidentSteps(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        common.daemon()

    def assert_trains_as_torch(self, case):
        got = {}
        sock, job = common.socket(), common.job("resident-steps-" + case)
        common.launch_ranks(rank_main, lambda r, q: (r, WORLD, sock, job, case, q),
                            WORLD, lambda m: got.__setitem__((m[0], m[1]), m[2:]))
        ref_losses, ref_reads = reference(case)
        for s in range(STEPS):
            mean = sum(got[("out", r)][0][s] for r in range(WORLD)) / WORLD
            self.assertAlmostEqual(mean, ref_losses[s], delta=TOL * abs(ref_losses[s]),
                                   msg="%s: step %d loss" % (case, s))
            for r in range(WORLD):
                for n, p in ref_reads[s].items():
                    d = float((torch.from_numpy(got[("out", r)][1][s][n]) - p).abs().max())
                    self.assertLess(d / max(float(p.abs().max()), 1e-12), TOL,
                                    "%s: rank %d read %s after step %d" % (case, r, n, s))

    def test_two_optimizers_over_different_units_train_as_torch(self):
        self.assert_trains_as_torch("two_optims")

    def test_a_skipped_step_of_one_optimizer_trains_as_torch(self):
        self.assert_trains_as_torch("skip")
        self.assert_trains_as_torch("skip_no_gather")

    def test_a_state_dict_loaded_between_steps_trains_as_torch(self):
        self.assert_trains_as_torch("load")


if __name__ == "__main__":
    unittest.main()
