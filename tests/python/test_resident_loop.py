"""A resident client's loop (reshard_after_forward=False, FSDP's
SHARD_GRAD_OP) against one process of plain torch, 2 ranks, the nested MLP
of models.py with a unit per child: the documented loop (gather, forward,
zero_grad, backward, scatter("mean"), step) trains as torch's, with
shardd.optim's step or sm.step over a registered optimizer, and without
zero_grad() gradients add up across steps as torch's do. Each collective
step forgotten is refused by name before anything changed (the daemon's
step count stays, the shards keep their values): a step after a backward
whose gradient no scatter() reduced (torch's plain loop
opt.zero_grad(); loss.backward(); opt.step(), or a second backward after
the scatter), a step with no scatter() since the last step (the daemon
would skip the gradient torch applies again), a forward after a step with
no gather() since (the parameters are the values before the step) or
before any gather() (initial_gather=False), a
clip_grad_norm_ of unreduced gradients; torch.optim over resident
parameters raises naming one."""
import unittest

import common
import shardd

if common.HAVE_TORCH:
    import torch
    from torch import nn
    import models
    import shardd.nn
    import shardd.optim

WORLD = 2
STEPS = 3
ROWS = 8
TOL = 1e-5
HYPER = dict(lr=0.1, momentum=0.9)
CLIP = 0.2  # "clip": below every step's gradient norm (0.41 to 0.47), so torch's clips


def make_model():
    return models.mlp(seed=0, dim=8, hidden=16, depth=2)


def batch(k, rank, world):
    g = torch.Generator().manual_seed(200 + k)
    x = torch.randn(ROWS, 8, generator=g)
    y = torch.randn(ROWS, 8, generator=g)
    per = ROWS // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def loss_of(model, k, rank, world):
    x, y = batch(k, rank, world)
    return nn.functional.mse_loss(model(x), y)


def reference(case):
    """Plain torch, one process, the whole batch: (losses, parameters)."""
    model = make_model()
    if case == "freeze":
        model.out.weight.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), **HYPER)
    losses = []
    for s in range(STEPS):
        if case not in ("accumulate", "clip_accumulate") or s == 0:
            opt.zero_grad()
        loss = loss_of(model, s, 0, 1)
        loss.backward()
        if case == "clip_accumulate":
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def shards(sm):
    """This rank's shards, read without a gather (full_parameters() gathers,
    which would refresh the parameters a forgotten gather() left stale)."""
    return [u.buffer.shard_tensor.clone() for u in sm.units]


def _count_collectives(client):
    """The names of the collective requests client sends from now on, in
    order (a list the caller reads and clears)."""
    sent = []
    for name in ("gather", "gather_many", "scatter", "scatter_many", "step"):
        fn = getattr(client, name)
        setattr(client, name, lambda *a, fn=fn, name=name, **k: (sent.append(name),
                                                                  fn(*a, **k))[1])
    return sent


def _step_whose_gather_fails(client, step, model, s, rank, world):
    """step() whose own gather fails before it is sent (on every rank, as a
    lost peer fails it): -> what a forward and an EMA's read of the
    parameters then say (both refused, naming sm.gather())."""
    real = client.gather_many

    def fail(*args, **kwargs):
        client.gather_many = real
        raise shardd.Error(13, "the test's gather failure", "E_PEER_LOST")
    client.gather_many = fail
    try:
        step()
    except shardd.Error:
        pass
    out = []
    for read in (lambda: loss_of(model, s, rank, world),
                 lambda: [torch.zeros_like(p).add_(p.detach()) for p in model.parameters()]):
        try:
            with torch.no_grad():
                read()
            out.append(None)
        except RuntimeError as e:
            out.append(str(e))
    return out


def rank_main(rank, world, sock, job, case, q):
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=world, transient_areas=False)
        model = make_model()
        sm = shardd.nn.ShardedModule(client, model, auto_wrap="children",
                                     initial_gather=case != "ungathered")
        if case == "torch_optim":
            opt = torch.optim.SGD(model.parameters(), **HYPER)
            sm.gather()
            sm.zero_grad()
            loss_of(model, 0, rank, world).backward()
            sm.scatter("mean")
            try:
                opt.step()
                q.put(("refused", rank, None))
            except Exception as e:
                q.put(("refused", rank, "%s: %s" % (type(e).__name__, e)))
            client.close()
            q.put(("done", rank))
            return
        direct = case.endswith("+direct")  # client.step(opt), below the wrapper
        case = case.split("+")[0]
        if case == "registered" or direct:
            opt = sm.register_optimizer("sgd", model.parameters(), **HYPER)
            step = (lambda: client.step(opt)) if direct else (lambda: sm.step(opt))
            count = opt.steps
        else:
            opt = shardd.optim.SGD(model.parameters(), **HYPER)
            step = opt.step
            count = lambda: opt.steps  # noqa: E731
        if case == "freeze":  # the Client's, below the wrapper, on every rank
            client.set_requires_grad(sm.view_of(model.out.weight), False)
        sent = _count_collectives(client)
        losses, refused = [], None
        for s in range(STEPS):
            at = count()
            before = shards(sm)
            try:
                if case == "step_gather_fails":
                    sm.gather()
                    sm.zero_grad()
                    loss = loss_of(model, s, rank, world)
                    loss.backward()
                    sm.scatter("mean")
                    if s == 1:
                        q.put(("after_failed_gather", rank, _step_whose_gather_fails(
                            client, step, model, s, rank, world)))
                    else:
                        step()
                elif case in ("documented", "registered", "accumulate", "clip_accumulate",
                              "freeze"):
                    sm.gather()
                    if case not in ("accumulate", "clip_accumulate") or s == 0:
                        sm.zero_grad()
                    loss = loss_of(model, s, rank, world)
                    loss.backward()
                    sm.scatter("mean")
                    if case == "clip_accumulate" and direct:
                        client.clip_grad_norm(opt, CLIP)
                    elif case == "clip_accumulate":
                        sm.clip_grad_norm_(CLIP)
                    step()
                elif case == "plain" and direct:  # no scatter
                    sm.gather()
                    sm.zero_grad()
                    loss = loss_of(model, s, rank, world)
                    loss.backward()
                    step()
                elif case == "plain":  # torch's loop, no gather or scatter
                    opt.zero_grad()
                    loss = loss_of(model, s, rank, world)
                    loss.backward()
                    opt.step()
                elif case == "backward_after_scatter":
                    sm.gather()
                    sm.zero_grad()
                    loss = loss_of(model, s, rank, world)
                    loss.backward(retain_graph=True)
                    sm.scatter("mean")
                    loss.backward()
                    step()
                elif case == "step_twice":  # torch's second step applies the .grad again
                    sm.gather()
                    sm.zero_grad()
                    loss = loss_of(model, s, rank, world)
                    loss.backward()
                    sm.scatter("mean")
                    step()
                    at = count()
                    before = shards(sm)
                    step()
                elif case == "ungathered":  # initial_gather=False, no gather() yet
                    opt.zero_grad()
                    loss = loss_of(model, s, rank, world)
                    loss.backward()
                    sm.scatter("mean")
                    step()
                elif case == "no_gather":  # a forward after the step, no gather() but the first
                    if s == 0:
                        sm.gather()
                    sm.zero_grad()
                    loss = loss_of(model, s, rank, world)
                    loss.backward()
                    sm.scatter("mean")
                    step()
                elif case == "clip":  # the norm of gradients no scatter reduced
                    sm.gather()
                    sm.zero_grad()
                    loss = loss_of(model, s, rank, world)
                    loss.backward()
                    if direct:  # the Client's, below the wrapper
                        client.clip_grad_norm(opt, CLIP)
                    else:
                        sm.clip_grad_norm_(CLIP)
                    sm.scatter("mean")
                    step()
                losses.append(loss.item())
                q.put(("sent", rank, s, list(sent)))
                del sent[:]
            except RuntimeError as e:
                after = shards(sm)
                unchanged = all(torch.equal(a, b) for a, b in zip(before, after))
                refused = (s, str(e), count() == at, unchanged)
                break
        common.send_params(rank, q, sm)
        q.put(("out", rank, losses, refused))
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


@unittest.skipUnless(common.HAVE_TORCH, "torch not installed")
class ResidentLoop(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        common.daemon()

    def run_case(self, case):
        got = {}

        def on_msg(m):
            if m[0] == "params":
                got["params"] = m[1]
            elif m[0] == "sent":  # per rank and step
                got[m[:3]] = m[3]
            else:
                got[(m[0], m[1])] = m[2:]

        sock, job = common.socket(), common.job("resident-" + case)
        common.launch_ranks(rank_main, lambda r, q: (r, WORLD, sock, job, case, q),
                            WORLD, on_msg)
        return got

    def assert_trains_as_torch(self, case):
        got = self.run_case(case)
        ref_losses, ref_params = reference(case.split("+")[0])
        for r in range(WORLD):
            losses, refused = got[("out", r)]
            self.assertIsNone(refused, "rank %d" % r)
            # each rank's loss is its half's; their mean is the batch's
            self.assertEqual(len(losses), STEPS)
        mean = [sum(got[("out", r)][0][s] for r in range(WORLD)) / WORLD for s in range(STEPS)]
        for s in range(STEPS):
            self.assertAlmostEqual(mean[s], ref_losses[s], delta=TOL * abs(ref_losses[s]),
                                   msg="step %d loss" % s)
        for n, p in ref_params.items():
            d = float((torch.from_numpy(got["params"][n]) - p).abs().max()) / max(float(p.abs().max()), 1e-12)
            self.assertLess(d, TOL, n)
        return got

    def assert_refused(self, case, at_step, words):
        got = self.run_case(case)
        for r in range(WORLD):
            losses, refused = got[("out", r)]
            self.assertIsNotNone(refused, "rank %d trained %s without a word" % (r, losses))
            s, msg, count_kept, unchanged = refused
            self.assertEqual(s, at_step, msg)
            for w in words:
                self.assertIn(w, msg)
            self.assertTrue(count_kept, "the daemon stepped before the refusal: " + msg)
            self.assertTrue(unchanged, "the shards changed before the refusal: " + msg)

    def test_documented_loop_trains_as_torch(self):
        self.assert_trains_as_torch("documented")

    def test_registered_optimizer_trains_as_torch(self):
        self.assert_trains_as_torch("registered")

    def test_without_zero_grad_gradients_add_up_as_torch(self):
        self.assert_trains_as_torch("accumulate")

    def test_without_zero_grad_gradients_add_up_to_the_clipped_ones_as_torch(self):
        """A clip before each step, no zero_grad(): torch's clip_grad_norm_
        scales .grad in place, and the next backward adds to the clipped
        gradient. The daemon scales the gradient as it steps, so the grad
        areas (this rank's .grad) kept the unclipped one and the next
        step's sum was off, without a word; the step now scales what they
        keep as torch's clip does. With sm.clip_grad_norm_ and shardd.optim,
        and with client.clip_grad_norm and client.step below the wrapper."""
        self.assert_trains_as_torch("clip_accumulate")
        self.assert_trains_as_torch("clip_accumulate+direct")

    def test_a_view_frozen_through_the_client_stays_frozen_as_torch(self):
        """client.set_requires_grad(view, False), asked of the Client
        directly, below the wrapper: the wrapper, which takes the
        parameter's requires_grad for the truth, set the view trainable
        again at its next scatter and the daemon stepped it, without a
        word. The parameter now follows (requires_grad_(False)), so it
        trains as torch's frozen parameter (unchanged)."""
        self.assert_trains_as_torch("freeze")

    def test_torch_loop_without_scatter_refused(self):
        self.assert_refused("plain", 0, ["scatter(\"mean\")", "reduced"])

    def test_backward_after_scatter_refused(self):
        self.assert_refused("backward_after_scatter", 0, ["scatter(\"mean\")", "reduced"])

    def test_step_without_scatter_since_last_step_refused(self):
        self.assert_refused("step_twice", 0, ["scatter(\"mean\")", "since the last step"])

    def test_forward_after_step_without_gather_trains_as_torch(self):
        """The step gathers the units it changed, so a forward after it
        with no gather() computes with the stepped values (it was refused:
        the gathered copy held the values from before the step), as after
        ZeRO-2's step; and the loop meets the other ranks as often as the
        documented one: one scatter, one step and one gather request per
        step, the gather now the step's own (the wrapper's gather at
        construction stands for the loop's first gather())."""
        self.assert_trains_as_torch("no_gather")
        self.assert_trains_as_torch("no_gather+direct")
        for case in ("no_gather", "documented"):
            got = self.run_case(case)
            for r in range(WORLD):
                for s in range(STEPS):
                    self.assertEqual(got[("sent", r, s)],
                                     ["scatter_many", "step", "gather_many"], (case, r, s))

    def test_parameters_a_failed_step_gather_left_stale_are_refused_until_gather(self):
        """Where the step's own gather fails (a lost peer), the parameters
        keep the values from before the step: a forward and an in-place
        read of one are refused, naming sm.gather(); after it the run
        trains as torch's (the step itself was applied)."""
        got = self.assert_trains_as_torch("step_gather_fails")
        for r in range(WORLD):
            forward, read = got[("after_failed_gather", r)][0]
            self.assertIn("after an optimizer step with no sm.gather() since", forward or "")
            self.assertIn("call sm.gather()", read or "")

    def test_forward_before_any_gather_refused(self):
        self.assert_refused("ungathered", 0, ["gather()", "initial_gather=False"])

    def test_clip_of_unreduced_gradients_refused(self):
        self.assert_refused("clip", 0, ["scatter(\"mean\")", "reduced"])

    def test_client_step_keeps_the_loop_refusals(self):
        """client.step(opt) on the Client, below the wrapper, skipped every
        refusal sm.step(opt) makes: a forward after it with no gather()
        computed with the values before the step, a step after an
        unscattered backward or a second one applied nothing, all without a
        word. The same refusals now; the documented loop with it trains as
        torch."""
        self.assert_trains_as_torch("documented+direct")
        self.assert_refused("plain+direct", 0, ["sm.scatter(\"mean\")", "since the last sm.scatter()"])
        self.assert_refused("step_twice+direct", 0, ["no sm.scatter() since the last step"])

    def test_client_clip_of_unreduced_gradients_refused(self):
        """client.clip_grad_norm(opt) on the Client, below the wrapper, after
        a backward no scatter() reduced: it took the norm of the reduced
        gradient of the last scatter (none yet: zeros) and set the next
        step's scale from it, so the step after sm.scatter() applied the
        fresh gradient unclipped (torch's clip_grad_norm_ scales it), without
        a word. Refused as sm.clip_grad_norm_ refuses it, before anything
        changed."""
        self.assert_refused("clip+direct", 0, ["sm.scatter(\"mean\")", "client.clip_grad_norm()",
                                               "since the last sm.scatter()"])

    @unittest.skipIf(common.UNDER_ASAN, common.ASAN_CXX_THROW)
    def test_torch_optim_refused_by_name(self):
        got = self.run_case("torch_optim")
        for r in range(WORLD):
            (msg,) = got[("refused", r)]
            self.assertIsNotNone(msg, "rank %d: torch.optim stepped resident parameters" % r)
            self.assertIn("torch.optim", msg)
            self.assertIn("inp.weight", msg)


if __name__ == "__main__":
    unittest.main()
