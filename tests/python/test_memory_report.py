"""What a rank is told of its memory: ShardedModule.memory_stats() and
memory_summary() (torch's memory_stats / memory_summary in spirit) give
per rank its shards in the daemon, the transient areas it leases, the
job's bytes as `shardctl status` shows them, and what the trainer holds
outside the daemon; each number checked exactly against the daemon's own
(status, inspect) and against the layout, on 2 ranks."""
import json
import os
import subprocess
import unittest

import common
import shardd

if common.HAVE_TORCH:
    import torch
    from torch import nn
    import shardd.nn
    import shardd.optim


def _page(n):
    return (n + 4095) // 4096 * 4096


if common.HAVE_TORCH:
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a = nn.Linear(16, 64)
            self.b = nn.Linear(64, 8)
            self.register_buffer("scale", torch.ones(8))  # 32 bytes, the trainer's

        def forward(self, x):
            return self.b(torch.tanh(self.a(x))) * self.scale


SHARDCTL = os.environ.get("SHARDCTL_BIN") or os.path.join(
    os.path.dirname(os.environ.get("SHARDD_BIN", "build/shardd")), "shardctl")


def rank_main(rank, world, sock, job, q):
    try:
        torch.set_num_threads(1)
        c = shardd.Client(sock, job=job, rank=rank, world=world)
        m = Net()
        sm = shardd.nn.ShardedModule(c, m, auto_wrap="children")
        # more CPUs than the ranks' threads: prefetch="auto"'s trial runs
        # on any machine (the pool's slots below count its prefetch)
        sm._cpus = lambda: 64
        opt = shardd.optim.AdamW(m.parameters(), lr=1e-2)
        c.barrier()  # every rank wrapped, none gathered yet
        before = sm.memory_stats()
        c.barrier()
        inside = []
        # after the wrapper's pre-hook (hooks run in registration order): gathered
        m.a.register_forward_pre_hook(lambda *_: inside.append(sm.memory_stats()))
        x = torch.randn(4, 16)
        for _ in range(2):
            opt.zero_grad()
            m(x).sum().backward()
            opt.step()
        c.barrier()  # every rank stepped: the job's bytes are final
        after = sm.memory_stats()
        ctl = None
        if rank == 0:  # what an operator's `shardctl status` says of the job
            out = subprocess.run([SHARDCTL, "--socket", sock, "--json", "status"],
                                 capture_output=True, text=True, check=True).stdout
            ctl = [j for j in json.loads(out)["jobs"] if j["name"] == job]
        q.put(("stats", rank, after, inside[0], sm.memory_summary(),
               [(u.name, u.buffer.shard_numel, u.buffer.padded_numel) for u in sm.units],
               ctl, before))
        c.barrier()  # no rank closes before every rank read the status
        c.close()
        q.put(("done", rank))
    except BaseException as e:  # noqa: BLE001
        common.rank_failed(rank, q, e)


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class MemoryReportTest(unittest.TestCase):
    def test_memory_stats_agree_with_the_daemon_and_the_layout(self):
        d = common.own_daemon(devices=1)
        self.addCleanup(d.cleanup)
        self.addCleanup(d.stop)
        job = common.job("memreport")
        world = 2
        got = {}
        common.launch_ranks(rank_main, lambda r, q: (r, world, d.socket, job, q), world,
                            lambda msg: got.__setitem__(msg[1], msg[2:]))
        units = got[0][3]
        self.assertEqual([u[0] for u in units], ["a", "b"])
        # per rank and unit: the fp32 shard, its reduced gradient, AdamW's
        # exp_avg and exp_avg_sq, each page-rounded
        per_rank = sum(4 * _page(4 * n) for _, n, _ in units)
        slot_a, slot_b = (_page(4 * p) for _, _, p in units)
        slot = max(slot_a, slot_b)
        # what the pools may take: the node's gathered copies, world * (2 -
        # 1) + 1 slots that every rank reads, and 2 gradient slots per rank,
        # each as large as the largest unit
        worst = (world + 1) * slot + world * 2 * slot
        # what they take: a slot is made when a lease finds none free that
        # holds its unit, as large as that unit. The second step prefetches
        # (prefetch="auto"'s trial starts with it) b beside a: a slot each;
        # a rank's gradient areas are leased one at a time (b's, kept from
        # its forward, is scattered before a's backward leases a's): one
        # slot, grown to a's size
        gpool = slot_a + slot_b
        pool = gpool + world * slot_a
        for r in range(world):
            after, inside, text, _, _, before = got[r]
            # before the first gather the pool is reserved, not held
            self.assertEqual((before["job_pool_bytes"], before["job_pool_reserved_bytes"]),
                             (0, worst))
            self.assertEqual(before["job_bytes"], world * per_rank)
            self.assertEqual(after["job_pool_reserved_bytes"], worst - pool)
            self.assertEqual(after["rank"], r)
            self.assertEqual(after["shard_bytes"], per_rank)
            self.assertEqual(sum(u["bytes"] for u in after["units"]), per_rank)
            self.assertEqual(after["leased_bytes"], 0, "nothing leased between steps")
            # in a's forward (the first step: no prefetch yet) a is gathered
            self.assertEqual(inside["leased_bytes"], slot_a)
            self.assertEqual(inside["gathered_bytes"], slot_a)
            self.assertEqual([u["leased"] for u in inside["units"]], [["gather"], []])
            # one copy of a for both ranks
            self.assertTrue(inside["gather_shared"])
            self.assertEqual(inside["job_gathered_bytes"], slot_a)
            self.assertEqual(inside["job_gather_pool_bytes"], slot_a, "one slot made yet")
            self.assertEqual(after["job_gathered_bytes"], 0)
            self.assertEqual(after["trainer_bytes"], 32, "the buffer, nothing else")
            self.assertEqual(after["job_pool_bytes"], pool)
            self.assertEqual(after["job_persistent_bytes"], world * per_rank)
            self.assertEqual(after["job_bytes"], world * per_rank + pool)
            self.assertIn("rank %d" % r, text)
            self.assertIn("(%d bytes)" % per_rank, text)
            self.assertIn("the node's, one per unit for every local rank", text)
        # and shardctl status says the same of the job
        (ctl,) = got[0][4]
        self.assertEqual((ctl["bytes"], ctl["pool_bytes"], ctl["persistent_bytes"],
                          ctl["pool_reserved_bytes"]),
                         (got[0][0]["job_bytes"], pool, world * per_rank, worst - pool))
        self.assertEqual((ctl["gather_pool_bytes"], ctl["gathered_bytes"],
                          ctl["gathered_units"], ctl["gather_shared"]), (gpool, 0, 0, True))
