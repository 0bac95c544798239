"""sm.gathered_parameters(params, modifier_rank), DeepSpeed's
zero.GatheredParameters, on nanoGPT with a unit per Block and the tied
embedding in the root's unit (2 ranks, transient and resident areas):
writes made alike on every rank under modifier_rank=0 (a seeded draw on
the tied weight, a padding row zeroed, a bias filled) land in the shards
and train as torch does after the same writes on the unwrapped model;
DeepSpeed's habit of writing on the modifier rank alone (``if rank ==
0:``), which DeepSpeed's broadcast makes whole and shardd cannot, is
refused on both ranks naming the parameter, and so is a write under
modifier_rank=None (DeepSpeed drops it without a word): nothing written,
training as torch's without the write. Without the check, the rank-0-only
write would land in rank 0's part of the weight alone, without an error."""
import unittest

import common
import shardd

if common.HAVE_TORCH:
    import torch
    import models
    import shardd.nn
    import shardd.optim

STEPS = 2
TOL = 1e-5
ROWS = 2  # per rank
TIED = "transformer.wte.weight"
BIAS = "transformer.h.1.mlp.c_fc.bias"


def write(full):
    """What the script writes into the gathered copies (also torch's)."""
    g = torch.Generator().manual_seed(7)
    full[TIED].copy_(torch.randn(full[TIED].shape, generator=g) * 0.05)
    full["lm_head.weight"][3].zero_()  # HF's padding row, through the tied name
    full[BIAS].fill_(0.25)


def train(model, opt, ranks, world):
    for s in range(STEPS):
        opt.zero_grad()
        for r in ranks:  # the reference: each rank's share of the mean
            x, y = models.gpt_batch(models.GPTConfig(), s, r, world, rows=ROWS)
            (models.gpt_loss(model, x, y) / len(ranks)).backward()
        opt.step()


def rank_main(rank, world, sock, job, q, how, transient):
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=world,
                               transient_areas=transient,
                               client_name="test_gathered_parameters rank %d" % rank)
        model = models.nano_gpt()
        sm = shardd.nn.ShardedModule(client, model, auto_wrap={models.Block})
        if not transient:
            sm.gather()
        err = None
        try:
            if how == "every_rank":
                with sm.gathered_parameters([model.lm_head.weight, BIAS],
                                            modifier_rank=0) as full:
                    write(full)
            elif how == "rank0_only":
                with sm.gathered_parameters([model.lm_head.weight, BIAS],
                                            modifier_rank=0) as full:
                    if rank == 0:
                        write(full)
            elif how == "no_modifier":
                with sm.gathered_parameters() as full:
                    write(full)
            q.put(("keys", rank, sorted(full)))
        except ValueError as e:
            err = str(e)
        q.put(("refused", rank, err))
        opt = shardd.optim.AdamW(model.parameters(), lr=1e-2)
        if transient:
            train(model, opt, [rank], world)
        else:
            for s in range(STEPS):
                x, y = models.gpt_batch(models.GPTConfig(), s, rank, world, rows=ROWS)
                sm.gather()
                opt.zero_grad()
                models.gpt_loss(model, x, y).backward()
                sm.scatter()
                opt.step()
        common.send_params(rank, q, sm)
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class GatheredParametersTest(unittest.TestCase):

    def run_ranks(self, how, transient=True):
        world = 2
        job, sock = common.job("gathered-" + how), common.socket()
        return common.launch_collect(
            rank_main, lambda r, q: (r, world, sock, job, q, how, transient),
            world, timeout=120)

    def reference(self, written):
        torch.set_num_threads(1)
        ref = models.nano_gpt()
        if written:
            with torch.no_grad():
                write(dict(ref.named_parameters(), **{"lm_head.weight": ref.lm_head.weight}))
        train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), range(2), 2)
        return ref

    def assert_torchs(self, got, ref):
        for n, p in ref.named_parameters():
            self.assertLessEqual(common.max_rel(got["params"][n], p.detach().numpy()), TOL, n)

    def test_writes_alike_on_every_rank_land_in_the_shards_as_torchs(self):
        for transient in (True, False):
            got = self.run_ranks("every_rank", transient)
            for r in range(2):
                self.assertIsNone(got[("refused", r)])
                self.assertEqual(got[("keys", r)], sorted([TIED, "lm_head.weight", BIAS]))
            self.assert_torchs(got, self.reference(written=True))

    def test_a_write_on_the_modifier_rank_alone_is_refused_on_every_rank(self):
        got = self.run_ranks("rank0_only")
        for r in range(2):
            self.assertIn("ranks hold different values of %s, %s " % (BIAS, TIED),
                          got[("refused", r)])
            self.assertIn("no broadcast", got[("refused", r)])
        self.assert_torchs(got, self.reference(written=False))

    def test_a_write_without_modifier_rank_is_refused(self):
        got = self.run_ranks("no_modifier")
        for r in range(2):
            self.assertIn("%s, %s written with modifier_rank=None" % (BIAS, TIED),
                          got[("refused", r)])
        self.assert_torchs(got, self.reference(written=False))


if __name__ == "__main__":
    unittest.main()
