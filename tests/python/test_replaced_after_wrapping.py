"""A parameter replaced or converted behind the wrapper's back after
wrapping is refused at the next forward (transient areas: the root's
forward; resident: gather()), naming it, instead of training silently
otherwise than torch: ``module.weight = nn.Parameter(t)`` (the new tensor
would compute outside the shards, its gradient reduced by no rank, in no
state dict), ``model.to(device)``, ``model.double()`` / ``model.bfloat16()`` (they set ``p.data``
to a converted copy, which the next gather would drop, or with inputs left
fp32 the model would go on in fp32) and ``p.data = t`` (lost at the next
gather). Writes into the parameters (``model.apply`` of an init, in
place) still land in the shards on transient areas; on resident ones
(the gathered copy) the gather is refused (test_resident_writes). 2
ranks."""
import unittest

import common
import shardd

if common.HAVE_TORCH:
    import torch
    from torch import nn
    import shardd.nn

CASES = ("reassign", "double", "bfloat16", "device", "data", "apply")


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def change(model, case):
    if case == "reassign":
        model[0].weight = nn.Parameter(torch.zeros(8, 4))
    elif case == "double":
        model.double()
    elif case == "bfloat16":
        model.bfloat16()
    elif case == "device":  # as model.cuda() on the host backend
        model.to("meta")
    elif case == "data":
        model[2].bias.data = torch.zeros(2)
    else:  # in place, as torch's: lands in the shards
        model.apply(lambda m: nn.init.zeros_(m.bias) if isinstance(m, nn.Linear) else None)


def rank_main(rank, world, sock, job, transient, q):
    try:
        torch.set_num_threads(1)
        for case in CASES:
            client = shardd.Client(sock, job="%s-%s" % (job, case), rank=rank, world=world,
                                   transient_areas=transient)
            model = make_model()
            sm = shardd.nn.ShardedModule(client, model, auto_wrap="children")
            change(model, case)
            x = torch.ones(3, 4, dtype=torch.float64 if case == "double" else torch.float32)
            err = None
            try:
                if not transient:
                    sm.gather()
                model(x).sum().backward()
                if not transient:
                    sm.scatter()
            except RuntimeError as e:
                err = str(e)
            biases = None
            if err is None:
                full = sm.full_parameters()
                biases = (full["0.bias"].abs().sum().item(), full["2.bias"].abs().sum().item())
            q.put(("out", rank, case, err, biases))
            client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class ReplacedAfterWrappingTest(unittest.TestCase):

    def check(self, transient):
        job, sock, out = common.job("replaced"), common.socket(), {}
        common.launch_ranks(rank_main, lambda r, q: (r, 2, sock, job, transient, q), 2,
                            lambda m: out.__setitem__((m[1], m[2]), m[3:])
                            if m[0] == "out" else None)
        want = {"reassign": ("'0.weight' was replaced on its module", "Assign it before wrapping"),
                "double": ("'0.weight' is torch.float64", "model.half()"),
                "bfloat16": ("'0.weight' is torch.bfloat16", "mixed_precision="),
                "device": ("'0.weight' is on meta but its unit's shards are on cpu",
                           "model.to(device)"),
                "data": ("the .data of '2.bias' was replaced", "p.copy_(t)")}
        for r in range(2):
            for case in CASES:
                err, biases = out[(r, case)]
                label = "%s, %s, rank %d" % (case, "transient" if transient else "resident", r)
                if case == "apply" and not transient:
                    # the gathered copy written: the gather would lose it
                    self.assertIsNotNone(err, label)
                    self.assertIn("would be lost", err, label)
                    continue
                if case == "apply":
                    self.assertIsNone(err, label)
                    self.assertEqual(biases, (0.0, 0.0), label)
                    continue
                self.assertIsNotNone(err, label)
                for part in want[case]:
                    self.assertIn(part, err, label)

    def test_a_parameter_replaced_after_wrapping_is_refused_transient(self):
        self.check(True)

    def test_a_parameter_replaced_after_wrapping_is_refused_resident(self):
        self.check(False)


if __name__ == "__main__":
    unittest.main()
