"""On a resident client the parameters are views of the gather areas, the
gathered copy of the shards: a write into them between steps (an EMA
shrink, clamp_(), an init) would be overwritten by the next gather()
without a word. That gather (and full_parameters(), which gathers too) is
refused instead, naming the unit, before anything changed;
model.load_state_dict() after such a write replaces it and gathers, and
the gathers after it are accepted. 2 ranks."""
import unittest

import common
import shardd

if common.HAVE_TORCH:
    import torch
    from torch import nn
    import shardd.nn
    import shardd.optim


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def rank_main(rank, world, sock, job, q):
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=world, transient_areas=False)
        model = make_model()
        sm = shardd.nn.ShardedModule(client, model, auto_wrap="children")
        opt = shardd.optim.SGD(model.parameters(), lr=0.1)
        x = torch.ones(3, 4) * (rank + 1)
        sm.gather()
        opt.zero_grad()
        model(x).sum().backward()
        sm.scatter()
        opt.step()
        sm.gather()  # nothing written since the last: accepted
        before = sm.full_parameters()
        with torch.no_grad():  # an EMA-like shrink between steps
            for p in model[2].parameters():
                p.mul_(0.5)
        errs = []
        for what in ("gather", "full_parameters"):
            try:
                sm.gather() if what == "gather" else sm.full_parameters()
                errs.append(None)
            except RuntimeError as e:
                errs.append(str(e))
        sd = {k: v * 2 for k, v in before.items()}
        model.load_state_dict(sd)  # replaces the write, gathers
        sm.gather()
        after = sm.full_parameters()
        loaded = all(torch.equal(after[k], sd[k]) for k in sd)
        q.put(("out", rank, errs, loaded))
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class ResidentWritesTest(unittest.TestCase):

    def test_a_write_into_resident_parameters_is_not_lost_silently(self):
        job, sock, out = common.job("reswrite"), common.socket(), {}
        common.launch_ranks(rank_main, lambda r, q: (r, 2, sock, job, q), 2,
                            lambda m: out.__setitem__(m[1], m[2:]) if m[0] == "out" else None)
        for r in range(2):
            errs, loaded = out[r]
            for what, err in zip(("gather", "full_parameters"), errs):
                self.assertIsNotNone(err, "%s, rank %d" % (what, r))
                self.assertIn("unit '2'", err)
                self.assertIn("'2.weight'", err)
                self.assertIn("would be lost", err)
            self.assertTrue(loaded, r)


if __name__ == "__main__":
    unittest.main()
