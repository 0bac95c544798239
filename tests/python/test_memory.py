"""What a trainer keeps of the model in its own memory once it is wrapped:
the daemon holds the shards, so a rank's private memory (RssAnon) holds no
copy of the parameters beside them -- the original parameters' storage is
freed when their values are in the shards, as FSDP frees it -- while the
original parameter objects still name themselves (register_optimizer with
one says which parameter it was). A model built on the meta device is
materialized one module at a time into the shards, with the values of
building it on the CPU, never whole in a rank. Ranks are processes (forkserver) of one
job on the host backend (its areas are shared mappings: RssShmem, not
RssAnon)."""
import ctypes
import gc
import unittest

import common
import shardd

if common.HAVE_TORCH:
    import numpy as np
    import torch
    from torch import nn
    import shardd.nn
    import shardd.optim

DIM = 2048
LAYERS = 6              # 6 * (2048*2048 + 2048) = 25.2M parameters, 101 MB fp32
STEPS = 3
ROWS = 4


def rss_anon():
    """This process's private resident memory in bytes, after the C heap
    gave back its free pages (malloc_trim): what live objects hold, not
    what glibc keeps for reuse (a freed 16 MB block below a live one stays
    resident in the heap, or not, by the heap's layout)."""
    ctypes.CDLL(None).malloc_trim(0)
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def big_model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh())
                           for _ in range(LAYERS)])


if common.HAVE_TORCH:
    class Net(nn.Module):
        """Built on a device (device="meta": no memory); its constructors
        initialize through reset_parameters() in registration order; the
        head's weight is the embedding's (tied after both were built)."""

        def __init__(self, device=None, vocab=50, dim=24, depth=3):
            super().__init__()
            self.emb = nn.Embedding(vocab, dim, device=device)
            self.blocks = nn.ModuleList([
                nn.Sequential(nn.LayerNorm(dim, device=device),
                              nn.Linear(dim, 2 * dim, device=device), nn.Tanh(),
                              nn.Linear(2 * dim, dim, device=device),
                              nn.BatchNorm1d(dim, device=device))
                for _ in range(depth)])
            self.head = nn.Linear(dim, vocab, bias=False, device=device)
            self.head.weight = self.emb.weight  # tied: emb's values

        def forward(self, idx):
            x = self.emb(idx).reshape(idx.numel(), -1)  # rows for BatchNorm1d
            for b in self.blocks:
                x = x + b(x)
            return self.head(x)

    class BigNet(nn.Sequential):
        def __init__(self, device=None):
            super().__init__(*[nn.Sequential(nn.Linear(DIM, DIM, device=device), nn.Tanh())
                               for _ in range(LAYERS)])


def meta_rank(rank, world, sock, job, name, q):
    """Wraps a model built on the meta device; -> its full parameters and
    buffers, a forward's output, and the peak of RssAnon while wrapping."""
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=world,
                               client_name="test_memory meta rank %d" % rank)
        gc.collect()
        base = rss_anon()
        torch.manual_seed(0)
        model = (Net if name == "net" else BigNet)(device="meta")
        peak = [0]

        def init(m):  # reset_parameters(), as the default, noting memory
            m.reset_parameters()
            peak[0] = max(peak[0], rss_anon() - base)

        # Net: the default (each module's reset_parameters()); the big one
        # notes the memory after each module's
        kw = dict(param_init_fn=init) if name == "big" else {}
        sm = shardd.nn.ShardedModule(client, model, auto_wrap="children", **kw)
        after_init = torch.rand(3)
        full = {k: v.clone() for k, v in sm.full_parameters().items()}
        bufs = {k: v.clone() for k, v in model.named_buffers()}
        out = None
        if name == "net":
            model.eval()
            with torch.no_grad():
                out = model(torch.arange(10).reshape(2, 5)).clone()
        if rank == 0:
            npd = lambda d: {k: v.numpy().copy() for k, v in d.items()}  # noqa: E731
            q.put(("meta", peak[0], npd(full) if name == "net" else None, npd(bufs),
                   None if out is None else out.numpy().copy(), after_init.numpy().copy()))
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


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
        common.rank_failed(rank, q, e)


@unittest.skipUnless(common.HAVE_TORCH, "torch not installed")
@unittest.skipIf(common.UNDER_ASAN, common.ASAN_MEMORY)
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
            print("\n  rank %d: private memory grew by %.1f MB (model %.1f MB)"
                  % (r, grown / 1e6, model_bytes / 1e6))
            # the whole model is 101 MB; what stays is allocator slack and
            # the activations of a few rows
            self.assertLess(grown, model_bytes // 2,
                            "rank %d: private memory grew by %d bytes for a model of %d"
                            % (r, grown, model_bytes))
            self.assertEqual(orig_numel, 0)
            self.assertIn("0.0.weight (the original parameter", named)


    def meta(self, name, world):
        job = common.job("meta")
        got = []
        common.launch_ranks(meta_rank, lambda r, q: (r, world, common.socket(), job, name, q),
                            world, lambda m: got.append(m[1:]), timeout=300)
        return got[0]

    def test_meta_built_model_gets_the_cpu_build_values(self):
        """Net built on the meta device and wrapped: every parameter and
        buffer is what building it on the CPU with the same seed gives, as
        is the RNG state after, whatever the world size."""
        torch.manual_seed(0)
        cpu = Net()
        cpu_after = torch.rand(3)
        cpu.eval()
        with torch.no_grad():
            want_out = cpu(torch.arange(10).reshape(2, 5))
        for world in (2, 3):
            peak, full, bufs, out, after = self.meta("net", world)
            self.assertEqual(sorted(full), sorted(n for n, _ in cpu.named_parameters()))
            for n, p in cpu.named_parameters():
                np.testing.assert_array_equal(full[n], p.detach().numpy(),
                                              "%s, %d ranks" % (n, world))
            self.assertEqual(sorted(bufs), sorted(n for n, _ in cpu.named_buffers()))
            for n, b in cpu.named_buffers():
                np.testing.assert_array_equal(bufs[n], b.numpy(), n)
            np.testing.assert_array_equal(out, want_out.numpy())
            np.testing.assert_array_equal(after, cpu_after.numpy(), "the RNG state after")

    def test_meta_built_model_is_never_whole_in_a_rank(self):
        """Wrapping a 101 MB model built on the meta device: a rank's
        private memory never holds half of it (one Linear at a time)."""
        peak, _, _, _, _ = self.meta("big", 2)
        model_bytes = LAYERS * (DIM * DIM + DIM) * 4
        print("\n  meta-built model of %.1f MB: private memory peak while wrapping %.1f MB"
              % (model_bytes / 1e6, peak / 1e6))
        self.assertGreater(peak, 0)
        self.assertLess(peak, model_bytes // 2, "peak %d bytes over the model's %d"
                        % (peak, model_bytes))


if __name__ == "__main__":
    unittest.main()
