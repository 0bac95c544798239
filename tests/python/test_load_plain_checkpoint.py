"""A plain torch checkpoint loaded into a wrapped nanoGPT (a unit per Block,
the tied wte / lm_head weight the root's; transient areas, 2 ranks) as
single-process torch loads it: ``model.state_dict()`` has torch's keys and
values; ``load_state_dict(sd, strict=False)`` with missing and unexpected
keys returns torch's keys and leaves every value as torch's; a strict
load with keys missing is torch's error; one with a key of another shape
is torch's error, naming that key alone (each other parameter was named
too, its part's shape against the whole one's), the other keys loaded as
torch's; and a checkpoint giving the tied
weight two values (one of an untied model) leaves torch's, the last
name's (lm_head), where the wrapper kept the first name's without a
word."""
import unittest

import common
import shardd

if common.HAVE_TORCH:
    import torch
    import models
    import shardd.nn


def _checkpoints():
    """(plain: every key its own perturbation, tied weights differing;
    part: Block 0's keys doubled and an unexpected key)."""
    ref = models.nano_gpt()
    g = torch.Generator().manual_seed(5)
    plain = {k: v + 0.01 * torch.randn(v.shape, generator=g)
             for k, v in ref.state_dict().items()}
    part = {k: v * 2 for k, v in plain.items() if ".h.0." in k}
    part["bogus.weight"] = torch.zeros(3)
    return plain, part


def _load_all(model, report):
    plain, part = _checkpoints()
    model.load_state_dict(plain)
    report("plain", model.state_dict())
    res = model.load_state_dict(part, strict=False)
    report("result", (sorted(res.missing_keys), sorted(res.unexpected_keys)))
    report("part", model.state_dict())
    try:
        model.load_state_dict({k: v for k, v in plain.items() if ".h.1." not in k})
        report("strict", None)
    except RuntimeError as e:
        report("strict", str(e).split("\n")[1])
    bad = dict(plain)
    bad["transformer.h.0.mlp.c_fc.weight"] = bad["transformer.h.0.mlp.c_fc.weight"].t()
    bad["transformer.h.1.mlp.c_fc.bias"] = bad["transformer.h.1.mlp.c_fc.bias"] + 1
    try:
        model.load_state_dict(bad)
        report("shape", None)
    except RuntimeError as e:
        report("shape", str(e).split("\n")[1:])
    report("after_shape", model.state_dict())


def rank_main(rank, world, sock, job, q):
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=world, transient_areas=True,
                               client_name="test_load_plain_checkpoint rank %d" % rank)
        model = models.nano_gpt()
        shardd.nn.ShardedModule(client, model, auto_wrap={models.Block})
        out = {"keys": list(model.state_dict())}

        def report(what, v):
            out[what] = {k: t.numpy().copy() for k, t in v.items()} if isinstance(v, dict) else v
        _load_all(model, report)
        q.put(("out", rank, out))
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class LoadPlainCheckpointTest(unittest.TestCase):

    def test_plain_checkpoints_load_as_torchs(self):
        torch.set_num_threads(1)
        world = 2
        want = {"keys": list(models.nano_gpt().state_dict())}

        def report(what, v):
            want[what] = {k: t.numpy().copy() for k, t in v.items()} if isinstance(v, dict) else v
        _load_all(models.nano_gpt(), report)
        job, sock = common.job("loadplain"), common.socket()
        got = common.launch_collect(rank_main, lambda r, q: (r, world, sock, job, q),
                                    world, timeout=120)
        for r in range(world):
            out = got[("out", r)]
            self.assertEqual(out["keys"], want["keys"])
            self.assertEqual(out["result"], want["result"])
            self.assertIn("bogus.weight", out["result"][1])
            self.assertEqual(out["strict"], want["strict"])
            self.assertIn("Missing key(s)", out["strict"])
            # a key of another shape: torch's message alone, the others loaded
            self.assertEqual(out["shape"], want["shape"])
            self.assertEqual(len(out["shape"]), 1)
            for what in ("plain", "part", "after_shape"):
                for k, v in want[what].items():
                    self.assertEqual(common.max_rel(out[what][k], v), 0, (what, k))


if __name__ == "__main__":
    unittest.main()
