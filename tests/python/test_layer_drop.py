"""LayerDrop over transient per-block units (auto_wrap={Blk}), 2 ranks
against one process of torch.optim on the global batch: a block skipped
on every rank alike (the draw from a generator seeded alike) trains as
torch, the skipped block's parameters stepped by neither (.grad None on
every rank); a block skipped on one rank only (a draw per rank) makes the
ranks' forwards gather different units, which the daemon refuses
(E_MISMATCH, after --peer-grace: it cannot tell a slow rank sooner), and
the refusal names the unit and says why (it said only that the ranks'
collectives differed). No rank trains on silently."""
import unittest

import common
import shardd

if common.HAVE_TORCH:
    import torch
    from torch import nn
    import shardd.nn

WORLD = 2
STEPS = 3
ROWS = 8
D = 6
TOL = 1e-5
HYPER = dict(lr=1e-2, weight_decay=0.1)

if common.HAVE_TORCH:
    class Blk(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, x):
            return x + torch.tanh(self.lin(x))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(D, D)
            self.blocks = nn.ModuleList(Blk() for _ in range(4))
            self.head = nn.Linear(D, 2)
            self.drop = set()

        def forward(self, x):
            h = self.inp(x)
            for i, b in enumerate(self.blocks):
                if i not in self.drop:
                    h = b(h)
            return self.head(h)


def make_model():
    torch.manual_seed(0)
    return Model()


def drops(case, step, rank):
    """The blocks skipped at step on rank."""
    if step != 1:
        return set()
    if case == "alike":
        return {1, 2}
    return {1} if rank == 0 else set()  # "per_rank"


def data():
    g = torch.Generator().manual_seed(7)
    return torch.randn(STEPS, ROWS, D, generator=g), torch.randn(STEPS, ROWS, 2, generator=g)


def reference(case):
    model = make_model()
    x, y = data()
    opt = torch.optim.AdamW(model.parameters(), foreach=False, **HYPER)
    per = ROWS // WORLD
    for s in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = 0
        for r in range(WORLD):
            model.drop = drops(case, s, r)
            loss = loss + nn.functional.mse_loss(model(x[s, r * per:(r + 1) * per]),
                                                 y[s, r * per:(r + 1) * per])
        (loss / WORLD).backward()
        opt.step()
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def rank_main(rank, world, sock, job, case, q):
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=world, transient_areas=True)
        model = make_model()
        sm = shardd.nn.ShardedModule(client, model, auto_wrap={Blk})
        opt = torch.optim.AdamW(model.parameters(), foreach=False, **HYPER)
        x, y = data()
        per = ROWS // world
        lo, hi = rank * per, (rank + 1) * per
        err = None
        try:
            for s in range(STEPS):
                model.drop = drops(case, s, rank)
                opt.zero_grad(set_to_none=True)
                nn.functional.mse_loss(model(x[s, lo:hi]), y[s, lo:hi]).backward()
                opt.step()
        except shardd.Error as e:
            err = "%s: %s" % (e.code_name, e.message)
        q.put(("out", rank, err))
        if err is None:
            common.send_params(rank, q, sm)
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


@unittest.skipUnless(common.HAVE_TORCH, "torch not installed")
class LayerDrop(unittest.TestCase):
    def run_case(self, case):
        sock, job = common.socket(), common.job("layerdrop-" + case)
        return common.launch_collect(rank_main, lambda r, q: (r, WORLD, sock, job, case, q), WORLD)

    def test_blocks_skipped_alike_on_every_rank_train_as_torch(self):
        got = self.run_case("alike")
        for r in range(WORLD):
            self.assertIsNone(got[("out", r)])
        want = reference("alike")
        for n in want:
            self.assertLessEqual(common.max_rel(got["params"][n], want[n]), TOL, n)

    def test_a_block_skipped_on_one_rank_only_is_refused_naming_it(self):
        got = self.run_case("per_rank")
        errs = [got[("out", r)] for r in range(WORLD)]
        self.assertTrue(all(errs), "a rank trained on without a word: %s" % errs)
        for err in errs:
            self.assertTrue(err.startswith("E_MISMATCH"), err)
            # rank 0 gathers blocks.2 where rank 1 gathers blocks.1: each
            # rank's refusal names the unit its own forward gathered
            self.assertRegex(err, r"unit 'blocks\.[12]''s gather for its forward")
            self.assertIn("LayerDrop drawn per rank", err)


if __name__ == "__main__":
    unittest.main()
