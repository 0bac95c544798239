"""On a resident client the parameters are views of the gather areas, the
gathered copy of the shards: a write into them between steps (an EMA
shrink, clamp_(), an init) would be overwritten by the next gather()
without a word. That gather (and full_parameters(), which gathers too) is
refused instead, naming the unit, before anything changed, and so is a
gather asked of the Client directly (client.gather, gather_async,
gather_many);
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


# the gathers refused: the wrapper's, and the Client's asked directly,
# below it (they overwrote the write, and the forward after them, with no
# step since, computed with the shards' values without a word)
WAYS = ("gather", "full_parameters", "client.gather", "client.gather_async",
        "client.gather_many")


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
        written = model[2].weight.detach().clone()
        unit = [u for u in sm.units if u.name == "2"][0]
        errs = []
        for what in WAYS:
            try:
                if what == "gather":
                    sm.gather()
                elif what == "full_parameters":
                    sm.full_parameters()
                elif what == "client.gather":  # the Client's, below the wrapper
                    client.gather(unit.buffer)
                elif what == "client.gather_async":
                    client.wait(client.gather_async(unit.buffer))
                else:
                    client.gather_many([u.buffer for u in sm.units])
                errs.append(None)
            except RuntimeError as e:
                errs.append(str(e))
        kept = torch.equal(model[2].weight, written)  # the write is still there
        sd = {k: v * 2 for k, v in before.items()}
        model.load_state_dict(sd)  # replaces the write, gathers
        sm.gather()
        after = sm.full_parameters()
        loaded = all(torch.equal(after[k], sd[k]) for k in sd)
        q.put(("out", rank, errs, kept, loaded))
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
            errs, kept, loaded = out[r]
            self.assertTrue(kept, "rank %d: a refused gather overwrote the write" % r)
            for what, err in zip(WAYS, errs):
                self.assertIsNotNone(err, "%s, rank %d" % (what, r))
                self.assertIn("unit '2'", err)
                self.assertIn("'2.weight'", err)
                self.assertIn("would be lost", err)
            self.assertTrue(loaded, r)


if __name__ == "__main__":
    unittest.main()
