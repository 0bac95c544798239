"""What a trainer keeps of the model in its own memory once it is wrapped:
the daemon holds the shards, so a rank's private memory (RssAnon) holds no
copy of the parameters beside them -- the original parameters' storage is
freed when their values are in the shards, as FSDP frees it -- while the
original parameter objects still name themselves (register_optimizer with
one says which parameter it was). Ranks are processes (forkserver) of one
job on the host backend (its areas are shared mappings: RssShmem, not
RssAnon)."""
import gc
import unittest

import common
import shardd

if common.HAVE_TORCH:
    import torch
    from torch import nn
    import shardd.nn
    import shardd.optim

DIM = 2048
LAYERS = 6              # 6 * (2048*2048 + 2048) = 25.2M parameters, 101 MB fp32
STEPS = 3
ROWS = 4


def rss_anon():
    """This process's private resident memory in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def big_model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh())
                           for _ in range(LAYERS)])


def rank_main(rank, world, sock, job, q):
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=world,
                               client_name="test_memory rank %d" % rank)
        gc.collect()
        base = rss_anon()
        model = big_model()
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        orig = list(model.parameters())
        sm = shardd.nn.ShardedModule(client, model, auto_wrap="children")
        opt = shardd.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(rank)
        for _ in range(STEPS):
            x = torch.randn(ROWS, DIM, generator=g)
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        gc.collect()
        grown = rss_anon() - base
        # the original objects stay (ids unique, names), without storage
        named = sm.param_groups([orig[0]])[0]["params"][0][0]
        q.put(("mem", rank, grown, model_bytes, sum(p.numel() for p in orig), named))
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        import traceback
        q.put(("error", rank, "%s\n%s" % (e, traceback.format_exc())))
        raise SystemExit(1)


@unittest.skipUnless(common.HAVE_TORCH, "torch not installed")
class TrainerMemoryTest(unittest.TestCase):
    def test_wrapping_keeps_no_copy_of_the_parameters(self):
        world = 2
        job = common.job("mem")
        sock = common.socket()
        got = {}
        common.launch_ranks(rank_main, lambda r, q: (r, world, sock, job, q), world,
                            lambda m: got.__setitem__(m[1], m[2:]), timeout=300)
        self.assertEqual(sorted(got), list(range(world)))
        for r, (grown, model_bytes, orig_numel, named) in got.items():
            self.assertEqual(model_bytes, LAYERS * (DIM * DIM + DIM) * 4)
            # the whole model is 101 MB; what stays is allocator slack and
            # the activations of a few rows
            self.assertLess(grown, model_bytes // 2,
                            "rank %d: private memory grew by %d bytes for a model of %d"
                            % (r, grown, model_bytes))
            self.assertEqual(orig_numel, 0)
            self.assertIn("0.0.weight (the original parameter", named)


if __name__ == "__main__":
    unittest.main()
