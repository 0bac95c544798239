"""Writes that take a transient unit's parameter, outside forward its 1-D
part of this rank's shard, for the whole parameter (2 ranks):

* an EMA copy made before wrapping and updated over ``zip(ema.parameters(),
  model.parameters())`` (``e.mul_(d).add_(p.detach(), alpha=1 - d)``), and
  SWA's ``AveragedModel.update_parameters`` (``copy_``), and the same
  over lists (``torch._foreach_add_``, timm's ModelEmaV3), are refused naming
  the parameter and ``model.state_dict()``: where each part's length is
  the last dimension or 1 (Linear(4, 2) and Linear(2, 2) without bias,
  one unit each) torch broadcast the part over the whole EMA tensor
  without a word, and on nanoGPT's shapes it failed on the shapes, naming
  neither;
* HF's ``_init_weights`` after wrapping (``weight.data.normal_()`` then
  ``weight.data[padding_idx].zero_()``) zeroed element padding_idx of each
  rank's part, not torch's padding row: refused, naming the embedding;
  nn.Embedding's own ``reset_parameters()`` after wrapping zeroes torch's
  padding row, every parameter as torch's init with the same seed.

* writes by index into a part or a view of one (``index_fill_``,
  ``scatter_``, ``index_put_``, ...), with a mask of the whole's shape
  (``masked_fill_``), the ``out=`` of ``torch.lerp`` / ``torch.add`` /
  ``torch.maximum`` / ``minimum`` / ``clamp`` / ``where`` / ``addmm`` (the
  part as the bias), ``e.clamp_(min=p)``, ``copysign_``, ``pow_``,
  ``lerp_`` with the part as the weight, ``multiply_`` (an alias of
  ``mul_``) and ``ema[:] = p`` went on silently (or failed naming
  nothing): refused, naming the parameter; once the client is closed
  torch's own methods are back.

The EMA kept as parts (``p.detach().clone()`` after wrapping), writes by
a mask of the part's shape or into an ``out=`` of it, and the
optimizer's own writes stay torch's (the training beside them)."""
import copy
import unittest

import common
import shardd

if common.HAVE_TORCH:
    import torch
    from torch import nn
    import models
    import shardd.nn
    import shardd.optim

DECAY = 0.9
TOL = 1e-5
STEPS = 3


if common.HAVE_TORCH:
    class _Padded(nn.Module):
        """An HF-like model: a padded embedding in a submodule, blocks."""

        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.embeddings = nn.Module()
            self.embeddings.word = nn.Embedding(12, 6, padding_idx=5)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Tanh())
                                        for _ in range(2))
            self.head = nn.Linear(6, 3)

        def forward(self, x):
            h = self.embeddings.word(x).mean(1)
            for b in self.blocks:
                h = b(h)
            return self.head(h)

    def _hf_init(module):  # HF's _init_weights
        if isinstance(module, nn.Embedding):
            module.weight.data.normal_(mean=0.0, std=0.02)
            if module.padding_idx is not None:
                module.weight.data[module.padding_idx].zero_()


def _broadcasting():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 2, bias=False), nn.Tanh(), nn.Linear(2, 2, bias=False))


def _refusal(fn):
    try:
        fn()
    except RuntimeError as e:
        return str(e)
    return None


def _ema_update(ema, model):
    with torch.no_grad():
        held = ema if isinstance(ema, list) else ema.parameters()
        for e, p in zip(held, model.parameters()):
            e.mul_(DECAY).add_(p.detach(), alpha=1 - DECAY)


def _foreach_update(ema, model):
    with torch.no_grad():  # timm's ModelEmaV3, over the parameters
        held = list(ema.parameters())
        torch._foreach_mul_(held, DECAY)
        torch._foreach_add_(held, [p.detach() for p in model.parameters()], alpha=1 - DECAY)


def _sum_update(total, model):
    with torch.no_grad():  # a running sum for an average (SWA by hand)
        for t, p in zip(total.parameters(), model.parameters()):
            t += p.detach()


def _running_max(ema, model):
    with torch.no_grad():  # a running maximum of the weights, as an EMA is kept
        for e, p in zip(ema.parameters(), model.parameters()):
            torch.maximum(e, p.detach(), out=e)


def _lerp_by_name(ema, model):
    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters()):
            e.lerp_(end=p.detach(), weight=1 - DECAY)


def _one_element_value(model):
    """A part scaled by a one-element tensor: the part's shape, torch's."""
    with torch.no_grad():
        for p in model.parameters():
            p.data.mul_(torch.full((1,), 2.0))
    return [p.detach().clone() for p in model.parameters()]


def _whole_part_item(model):
    """p.data[:] = t, the whole part written (as copy_): torch's."""
    with torch.no_grad():
        for p in model.parameters():
            p.data[:] = p.data * 0.5
    return [p.detach().clone() for p in model.parameters()]


def _index_writes(model, ema):
    """{case: refusal} for the writes by index, out= and item assignment
    that met a part as the whole parameter without a word."""
    w = model[0].weight  # its part, (4,) of (2, 4)
    e = ema[0].weight
    i = torch.tensor([1])
    cases = {
        "index_fill_": lambda: w.data.index_fill_(0, i, 0.0),
        "view_index_fill_": lambda: w.data[1:3].index_fill_(0, i, 0.0),
        "masked_fill_": lambda: w.data.masked_fill_(torch.ones(2, 4, dtype=torch.bool), 0.0),
        "scatter_": lambda: w.data.scatter_(0, i, 0.0),
        "index_copy_": lambda: w.data.index_copy_(0, i, torch.zeros(1)),
        "index_add_": lambda: w.data.index_add_(0, i, torch.ones(1)),
        "masked_scatter_": lambda: e.data.masked_scatter_(torch.tensor([[True] * 4, [False] * 4]),
                                                          w.detach()),
        "view_setitem": lambda: w.data[1:3].__setitem__(0, 1.0),
        "put_": lambda: w.data.put_(i, torch.zeros(1)),
        "index_put_": lambda: w.data.index_put_((i,), torch.zeros(1)),
        "lerp_out": lambda: torch.lerp(e.data, w.detach(), 1 - DECAY, out=e.data),
        "add_out": lambda: torch.add(e.data, w.detach(), alpha=1 - DECAY, out=e.data),
        "item_value": lambda: e.data.__setitem__(slice(None), w.detach()),
        # torch's other functions with out= and in-place methods that take a
        # tensor operand: each broadcast the part over e without a word
        "maximum_out": lambda: torch.maximum(e.data, w.detach(), out=e.data),
        "minimum_out": lambda: torch.minimum(e.data, w.detach(), out=e.data),
        "clamp_out": lambda: torch.clamp(e.data, min=w.detach(), out=e.data),
        "where_out": lambda: torch.where(e.data > 0, e.data, w.detach(), out=e.data),
        "addmm_out": lambda: torch.addmm(w.detach(), torch.ones(2, 3), torch.ones(3, 4),
                                         out=e.data),
        "clamp_": lambda: e.data.clamp_(min=w.detach()),
        "copysign_": lambda: e.data.copysign_(w.detach()),
        "pow_": lambda: e.data.pow_(w.detach()),
        "lerp_weight": lambda: e.data.lerp_(torch.ones(2, 4), w.detach()),
        "multiply_": lambda: e.data.multiply_(w.detach()),
    }
    with torch.no_grad():
        return {k: _refusal(f) for k, f in cases.items()}


def _part_shaped_index_writes(model):
    """Writes by mask or into an out= of the part's shape, between tensors
    of its shape: element-wise, torch's."""
    def writes(d):
        d.masked_fill_(d < 0, 0.0)
        d[d > 0.25] = 0.25
        torch.mul(d, 2.0, out=d)
        torch.add(d, torch.ones_like(d), out=d)
        e = torch.empty_like(d)
        e[:] = d
        d.copy_(e)
    with torch.no_grad():
        want = [p.detach().clone() for p in model.parameters()]  # not parts
        for t in want:
            writes(t)
        for p in model.parameters():
            writes(p.data)
    return all(torch.equal(p.detach(), t) for p, t in zip(model.parameters(), want))


def rank_main(rank, world, sock, job, q):
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=world, transient_areas=True,
                               client_name="test_part_writes rank %d" % rank)
        out = {}
        model = _broadcasting()
        ema = copy.deepcopy(model)
        swa = torch.optim.swa_utils.AveragedModel(model)
        shardd.nn.ShardedModule(client, model, auto_wrap={nn.Linear}, prefix="lin.")
        out["parts"] = [tuple(p.shape) for p in model.parameters()]
        out["ema"] = _refusal(lambda: _ema_update(ema, model))
        out["swa"] = _refusal(lambda: swa.update_parameters(model))
        out["foreach"] = _refusal(lambda: _foreach_update(ema, model))
        out["iadd"] = _refusal(lambda: _sum_update(ema, model))
        out["by_name"] = _refusal(lambda: _lerp_by_name(ema, model))
        before = [p.detach().clone() for p in model.parameters()]
        out["one_element"] = _refusal(lambda: out.__setitem__("scaled", _one_element_value(
            model)))
        out["whole_item"] = _refusal(lambda: out.__setitem__("halved", _whole_part_item(
            model)))
        out["index"] = _index_writes(model, ema)
        out["kept_shape"] = _refusal(lambda: out.__setitem__("as_torch", _part_shaped_index_writes(
            model)))
        out["halved"] = all(torch.equal(a, b) for a, b in zip(out.pop("halved", ()), before))
        out["doubled"] = all(torch.equal(a, 2 * b) for a, b in zip(out.pop("scaled", ()),
                                                                   before))

        gpt = models.nano_gpt()
        gpt_ema = copy.deepcopy(gpt)
        sm = shardd.nn.ShardedModule(client, gpt, auto_wrap={models.Block}, prefix="gpt.")
        kept = [p.detach().clone() for p in gpt.parameters()]  # an EMA as parts
        opt = torch.optim.SGD(gpt.parameters(), lr=0.1, momentum=0.9)
        for s in range(2):
            opt.zero_grad()
            x, y = models.gpt_batch(models.GPTConfig(), s, rank, world, rows=2)
            models.gpt_loss(gpt, x, y).backward()
            opt.step()
            _ema_update(kept, gpt)
        out["gpt_ema"] = _refusal(lambda: _ema_update(gpt_ema, gpt))
        out["gpt_max"] = _refusal(lambda: _running_max(gpt_ema, gpt))
        out["kept"] = [k.numpy().copy() for k in kept]
        out["gpt_parts"] = [p.detach().numpy().copy() for p in gpt.parameters()]

        padded = _Padded()
        psm = shardd.nn.ShardedModule(client, padded, auto_wrap={nn.Sequential}, prefix="pad.")
        out["hf_init"] = _refusal(lambda: padded.apply(_hf_init))
        out["row_mul"] = _refusal(lambda: padded.embeddings.word.weight.data[5].mul_(0))
        torch.manual_seed(3)
        for m in padded.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
        full = psm.full_parameters()
        out["reset"] = {n: t.numpy().copy() for n, t in full.items()}
        if rank == 0:
            q.put(("params", {n: t.numpy().copy() for n, t in sm.full_parameters().items()}))
        else:
            sm.full_parameters()
        client.close()
        # no wrapper's part is known any more: torch's own methods again
        out["off"] = (not part_ops_known(), type(torch.Tensor.add_).__name__,
                      type(torch.Tensor.__setitem__).__name__)
        q.put(("out", rank, out))
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


def part_ops_known():
    from shardd.nn import inits, part_ops
    return bool(inits._PARTS) or bool(part_ops._STALE)


def _reads(model):
    """What a script reads of the parameters right after a step: each one
    copied (``p.detach().clone()``), its norm for a log line, the loss of
    an evaluation forward (no gather() before it) and the state dict (a
    collective, every rank)."""
    with torch.no_grad():
        x, y = models.gpt_batch(models.GPTConfig(), 99, rows=2)
        return {"copies": {n: p.detach().clone().numpy() for n, p in model.named_parameters()},
                "norms": {n: float(p.norm()) for n, p in model.named_parameters()},
                "eval": float(models.gpt_loss(model, x, y)),
                "state": {k: v.numpy().copy() for k, v in model.state_dict().items()}}


def resident_main(rank, world, sock, job, q):
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=world, transient_areas=False,
                               client_name="test_part_writes resident rank %d" % rank)
        model = models.nano_gpt()
        ema = copy.deepcopy(model)
        sm = shardd.nn.ShardedModule(client, model, auto_wrap={models.Block})
        opt = shardd.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        reads = []
        for s in range(STEPS):
            sm.gather()
            opt.zero_grad()
            x, y = models.gpt_batch(models.GPTConfig(), s, rank, world, rows=2)
            models.gpt_loss(model, x, y).backward()
            sm.scatter("mean")
            opt.step()
            _ema_update(ema, model)  # no gather() since the step
            reads.append(_reads(model))
        if rank == 0:
            q.put(("params", {n: p.detach().numpy().copy() for n, p in ema.named_parameters()}))
            q.put(("reads", rank, reads))
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


def _reference_ema(world, steps, reads=None):
    """{name: torch's EMA} of nanoGPT after steps of SGD (momentum) on the
    mean of the ranks' gradients, updated after each step (and _reads()
    after each step appended to reads)."""
    gpt = models.nano_gpt()
    ema = {n: p.detach().clone() for n, p in gpt.named_parameters()}
    opt = torch.optim.SGD(gpt.parameters(), lr=0.1, momentum=0.9)
    for s in range(steps):
        opt.zero_grad()
        for r in range(world):
            x, y = models.gpt_batch(models.GPTConfig(), s, r, world, rows=2)
            (models.gpt_loss(gpt, x, y) / world).backward()
        opt.step()
        with torch.no_grad():
            for n, p in gpt.named_parameters():
                ema[n].mul_(DECAY).add_(p, alpha=1 - DECAY)
        if reads is not None:
            reads.append(_reads(gpt))
    return {n: t.numpy() for n, t in ema.items()}


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class PartWritesTest(unittest.TestCase):

    def test_whole_parameter_writes_on_parts_refused_or_torchs(self):
        torch.set_num_threads(1)
        world = 2
        job, sock = common.job("partwrites"), common.socket()
        got = common.launch_collect(rank_main, lambda r, q: (r, world, sock, job, q),
                                    world, timeout=120)
        # torch's init of the padded model with the same seed after construction
        ref = _Padded()
        torch.manual_seed(3)
        for m in ref.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
        ref_ema = _reference_ema(world, 2)
        for r in range(world):
            out = got[("out", r)]
            # each part broadcasts over its EMA tensor: (4,) over (2, 4), (2,) over (2, 2)
            self.assertEqual(out["parts"], [(4,), (2,)])
            for key, op in (("ema", "Tensor.add_"), ("swa", "Tensor.copy_"),
                            ("gpt_ema", "Tensor.add_"), ("foreach", "torch._foreach_add_"),
                            ("iadd", "Tensor.__iadd__"), ("by_name", "Tensor.lerp_")):
                msg = out[key] or ""
                self.assertIn("%s of a tensor of shape" % op, msg, key)
                self.assertIn("this rank's 1-D part", msg, key)
                self.assertIn("model.state_dict()", msg, key)
            self.assertIn("'0.weight'", out["ema"])
            for key, msg in out["index"].items():
                self.assertIn("'0.weight'", msg or "", key)
                self.assertIn("this rank's 1-D part", msg, key)
            self.assertIsNone(out["kept_shape"])
            self.assertTrue(out["as_torch"])
            self.assertEqual(out["off"], (True, "method_descriptor", "wrapper_descriptor"))
            self.assertIsNone(out["one_element"])
            self.assertTrue(out["doubled"])
            self.assertIsNone(out["whole_item"])
            self.assertTrue(out["halved"])  # doubled, then halved
            self.assertIn("'transformer.wte.weight'", out["gpt_ema"])
            self.assertIn("torch.maximum of a tensor of shape", out["gpt_max"] or "")
            self.assertIn("'transformer.wte.weight'", out["gpt_max"])
            # the parts' EMA: the optimizer's and the EMA's writes as torch's
            for (n, w), k, p in zip(ref_ema.items(), out["kept"], out["gpt_parts"]):
                flat = got["params"][n].reshape(-1)
                lo = [i for i in range(flat.size - p.size + 1)
                      if (flat[i:i + p.size] == p).all()][:1] if p.size else [0]
                self.assertTrue(lo, n)  # the part is a slice of the whole
                want = w.reshape(-1)[lo[0]:lo[0] + p.size]
                self.assertLessEqual(common.max_rel(k, want) if p.size else 0, TOL, n)
            msg = out["hf_init"] or ""
            self.assertIn("Tensor.zero_ of an element or row of 'embeddings.word.weight'",
                          msg)
            self.assertIn("load the whole parameter with model.load_state_dict()", msg)
            self.assertIn("Tensor.mul_ of an element or row of 'embeddings.word.weight'",
                          out["row_mul"] or "")
            for n, p in ref.named_parameters():
                self.assertLessEqual(common.max_rel(out["reset"][n],
                                                    p.detach().numpy()), 0, n)
            self.assertEqual(float(abs(out["reset"]["embeddings.word.weight"][5]).max()),
                             0.0)


    def test_resident_parameters_read_right_after_a_step_are_the_stepped_values(self):
        """Resident (nanoGPT per Block, tied embeddings, 2 ranks): the
        parameters are the gathered copy, which held the values from before
        the step until the loop's next gather(), so what read them right
        after the step was a step behind torch without a word: an EMA
        updated from them (refused once, naming sm.gather(); its plain
        copies p.detach().clone() and p.norm() for a log line were not).
        The step now gathers what it changed (as ZeRO-2's step does), so
        the EMA, the copies, the norms, an evaluation forward with no
        gather() before it and model.state_dict() are torch's after every
        step."""
        torch.set_num_threads(1)
        world = 2
        want_reads = []
        want = _reference_ema(world, STEPS, want_reads)
        job, sock = common.job("partwrites-res"), common.socket()
        got = common.launch_collect(resident_main, lambda r, q: (r, world, sock, job, q),
                                    world, timeout=120)
        for n, w in want.items():
            self.assertLessEqual(common.max_rel(got["params"][n], w), TOL, "EMA " + n)
        for s, (have, ref) in enumerate(zip(got[("reads", 0)], want_reads)):
            for n, w in ref["copies"].items():
                self.assertLessEqual(common.max_rel(have["copies"][n], w), TOL,
                                     "step %d copy of %s" % (s, n))
                self.assertAlmostEqual(have["norms"][n], ref["norms"][n],
                                       delta=TOL * ref["norms"][n], msg="step %d norm %s" % (s, n))
            self.assertAlmostEqual(have["eval"], ref["eval"], delta=TOL * ref["eval"],
                                   msg="step %d eval loss" % s)
            self.assertEqual(sorted(have["state"]), sorted(ref["state"]))
            for k, w in ref["state"].items():
                self.assertLessEqual(common.max_rel(have["state"][k], w), TOL,
                                     "step %d state %s" % (s, k))


if __name__ == "__main__":
    unittest.main()
