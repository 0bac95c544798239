"""A module reused across depth (ALBERT: one layer's module called N times
in one forward), wrapped (transient areas, 2 ranks), trains as
single-process torch.optim.SGD (momentum) on the mean of the ranks'
gradients: an nn.TransformerEncoderLayer called 3 times with an MLP
between, each its own unit or the layer alone one; two such modules
wrapped together in one unit (an nn.ModuleDict of them). Two reused
modules each its own unit, their calls interleaved, need a third gather
area in backward (each is held from its last call's backward to its
first's, beside the root unit's): refused, naming both ways that train,
where the refusal said a unit waited for a gradient that never comes
(a parameter the loss does not depend on, torch.autograd.grad())."""
import unittest

import common
import shardd

if common.HAVE_TORCH:
    import torch
    from torch import nn
    from torch.nn import functional as F
    import shardd.nn

STEPS = 3
TOL = 1e-5
CALLS = 3


if common.HAVE_TORCH:
    class _Albert(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.embed = nn.Linear(12, 16)
            self.shared = nn.ModuleDict({
                "layer": nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0,
                                                    batch_first=True),
                "mlp": nn.Sequential(nn.Linear(16, 16), nn.Tanh())})
            self.head = nn.Linear(16, 8)

        def forward(self, x):
            h = self.embed(x)
            for _ in range(CALLS):
                h = self.shared["layer"](h)
                h = h + self.shared["mlp"](h)
            return self.head(h.mean(1))

    WRAPS = {
        "layer": {nn.TransformerEncoderLayer},
        "together": {nn.ModuleDict},
        "apart": {nn.TransformerEncoderLayer, nn.Sequential},
    }


def _batch(step, rank):
    g = torch.Generator().manual_seed(100 + 1000 * step + rank)
    return torch.randn(4, 5, 12, generator=g), torch.randint(0, 8, (4,), generator=g)


def _train(model, ranks):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for s in range(STEPS):
        opt.zero_grad()
        for r in ranks:
            x, y = _batch(s, r)
            (F.cross_entropy(model(x), y) / len(ranks)).backward()
        opt.step()


def rank_main(rank, world, sock, job, wrap, q):
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=world, transient_areas=True,
                               client_name="test_shared_across_depth rank %d" % rank)
        model = _Albert()
        sm = shardd.nn.ShardedModule(client, model, auto_wrap=WRAPS[wrap])
        try:
            _train(model, [rank])
        except shardd.Error as e:
            q.put(("refused", rank, e.message))
            client.close()
            q.put(("done", rank))
            return
        params = sm.full_parameters()
        if rank == 0:
            q.put(("params", {n: t.numpy().copy() for n, t in params.items()}))
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class SharedAcrossDepthTest(unittest.TestCase):

    def run_wrap(self, wrap, world=2):
        job, sock = common.job("albert-" + wrap), common.socket()
        return common.launch_collect(rank_main, lambda r, q: (r, world, sock, job, wrap, q),
                                     world, timeout=120)

    def test_a_reused_layer_trains_as_torch(self):
        torch.set_num_threads(1)
        ref = _Albert()
        _train(ref, range(2))
        for wrap in ("layer", "together"):
            got = self.run_wrap(wrap)
            for n, p in ref.named_parameters():
                self.assertLessEqual(common.max_rel(got["params"][n], p.detach().numpy()),
                                     TOL, (wrap, n))

    @unittest.skipIf(common.UNDER_ASAN, common.ASAN_CXX_THROW)  # refused inside backward
    def test_interleaved_reused_units_refused_naming_the_way(self):
        got = self.run_wrap("apart")
        msgs = [v for k, v in got.items() if k[0] == "refused"]
        self.assertTrue(msgs, "no rank was refused")
        for m in msgs:
            self.assertIn("called %d times in one forward" % CALLS, m)
            self.assertIn("wrap the modules reused together in one unit", m)
            self.assertIn("leave all but one to the root's unit", m)


if __name__ == "__main__":
    unittest.main()
