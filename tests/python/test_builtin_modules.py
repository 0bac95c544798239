"""torch's built-in modules that read their own or a child's parameters
outside the child's forward, or keep references to them, train on a wrapped
model (2 ranks, transient and resident areas) as single-process torch does:
nn.MultiheadAttention (its forward reads out_proj's weight, out_proj's own
forward never runs), nn.TransformerEncoder (and its eval fast path under
no_grad, which reads every weight in one call), nn.LSTM / nn.GRU / nn.RNN
(their _flat_weights list of the parameter tensors), weight_norm /
spectral_norm (a forward pre-hook computing ``weight`` from other
parameters), torch.nn.utils.parametrize (parameters in a
ParametrizationList child), nn.Embedding(sparse=True) and nn.EmbeddingBag,
PReLU, LayerNorm without affine parameters (a unit with none), a branch
some steps skip, and a parent's F.linear over a child's (untied) weight.
Each with an auto_wrap that gives the reading child a unit of its own and
one that leaves it in its parent's. nn.Embedding(max_norm=...), which
renormalizes its weight in place during forward (a write into the gathered
copy, and per rank's indices), is refused at wrapping, naming the module,
as is a lazy module not run yet; an assignment through a parametrization
after wrapping is refused at the next forward, naming the parameter.
weight_norm / spectral_norm on the root module itself (their pre-hook came
before the wrapper's gather), BatchNorm with momentum=None or untracked
statistics, nn.Transformer and TransformerEncoder's nested-tensor fast
path (a key padding mask in eval) train and evaluate as torch.

The reference: one process of torch.optim.SGD (momentum) applying, per step,
the mean of each rank's micro-batch gradient (data parallelism's); the ranks
use torch.optim.SGD too (transient: it steps the shards; resident:
shardd.optim.SGD)."""
import functools
import unittest

import common
import shardd

if common.HAVE_TORCH:
    import numpy as np
    import torch
    from torch import nn
    from torch.nn import functional as F
    import shardd.nn
    import shardd.optim

STEPS = 3
ROWS = 8
WORLD = 2
TOL = 2e-5
LR, MOMENTUM = 0.05, 0.9


if common.HAVE_TORCH:
    class _MHA(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(16, 4, batch_first=True)
            self.head = nn.Linear(16, 8)

        def forward(self, x):
            return self.head(self.attn(x, x, x, need_weights=False)[0])

    class _Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
            self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(16, 8)

        def forward(self, x):
            return self.head(self.enc(x))

    class _PaddedEncoder(nn.Module):
        """TransformerEncoder with enable_nested_tensor and a key padding
        mask: in eval under no_grad its forward reads the first layer's
        weights itself (its nested-tensor fast path's check)."""

        def __init__(self):
            super().__init__()
            layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
            self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)
            self.head = nn.Linear(16, 8)

        def forward(self, x):
            pad = torch.zeros(x.shape[:2], dtype=torch.bool)
            pad[:, -2:] = True  # the last 2 positions are padding (left aligned)
            return self.head(self.enc(x, src_key_padding_mask=pad))

    class _RNN(nn.Module):
        def __init__(self, cls):
            super().__init__()
            self.rnn = cls(16, 12, num_layers=2, batch_first=True)
            self.head = nn.Linear(12, 8)

        def forward(self, x):
            return self.head(self.rnn(x)[0])

    class _Normed(nn.Module):
        def __init__(self, kind):
            super().__init__()
            self.a = nn.Linear(16, 16)
            if kind == "weight_norm":
                self.a = nn.utils.weight_norm(self.a)
            elif kind == "spectral_norm":
                self.a = nn.utils.spectral_norm(self.a)
            elif kind == "orthogonal":
                self.a = nn.utils.parametrizations.orthogonal(self.a)
            elif kind == "parametrize":
                nn.utils.parametrize.register_parametrization(self.a, "weight", _Symmetric())
            self.act = nn.PReLU(16)
            self.norm = nn.LayerNorm(16, elementwise_affine=False)
            self.head = nn.Linear(16, 8)

        def forward(self, x):
            return self.head(self.norm(self.act(self.a(x))))

    class _Symmetric(nn.Module):
        def forward(self, w):
            return w.triu() + w.triu(1).transpose(0, 1)

    class _Bag(nn.Module):
        def __init__(self, kind):
            super().__init__()
            if kind == "bag":
                self.emb = nn.EmbeddingBag(32, 16, mode="mean")
            else:
                self.emb = nn.Embedding(32, 16, padding_idx=0, sparse=kind == "sparse")
            self.kind = kind
            self.head = nn.Linear(16, 8)

        def forward(self, x):
            e = self.emb(x)
            if self.kind != "bag":
                e = e.mean(dim=1)
            return self.head(e)

    class _UntiedHead(nn.Module):
        """The parent calls F.linear over its child's weight (an untied
        lm_head read by the root, HF's pattern), and a branch (b) runs
        only on odd steps."""

        def __init__(self):
            super().__init__()
            self.a = nn.Linear(16, 16)
            self.b = nn.Linear(16, 16)
            self.head = nn.Linear(16, 8)
            self.step = 0

        def forward(self, x):
            h = torch.tanh(self.a(x))
            if self.step % 2:
                h = h + self.b(h)
            return F.linear(h, self.head.weight, self.head.bias)

    class _Transformer(nn.Module):
        """nn.Transformer: encoder and decoder layers (three attentions)."""

        def __init__(self):
            super().__init__()
            self.tr = nn.Transformer(16, 4, 1, 1, 32, dropout=0.0, batch_first=True)
            self.head = nn.Linear(16, 8)

        def forward(self, x):
            return self.head(self.tr(x, x[:, :4]))

    class _MaxNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(32, 16, max_norm=1.0)
            self.head = nn.Linear(16, 8)

        def forward(self, x):
            return self.head(self.emb(x).mean(dim=1))


def make_model(name):
    torch.manual_seed(0)
    if name == "mha":
        return _MHA()
    if name == "encoder":
        return _Encoder()
    if name in ("lstm", "gru", "rnn"):
        return _RNN({"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}[name])
    if name in ("weight_norm", "spectral_norm", "orthogonal", "parametrize"):
        return _Normed(name)
    if name in ("bag", "sparse", "padding"):
        return _Bag(name)
    if name == "untied":
        return _UntiedHead()
    if name == "max_norm":
        return _MaxNorm()
    if name == "lazy":  # not run yet: its weight has no shape
        return nn.Sequential(nn.LazyLinear(16), nn.Tanh(), nn.Linear(16, 8))
    if name == "root_weight_norm":  # the root's own pre-hook computes its weight
        return nn.utils.weight_norm(nn.Linear(16, 8))
    if name == "root_spectral_norm":
        return nn.utils.spectral_norm(nn.Linear(16, 8))
    if name == "batchnorm":
        return nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16, momentum=None),
                             nn.Tanh(), nn.BatchNorm1d(16, track_running_stats=False),
                             nn.Linear(16, 8))
    if name == "transformer":
        return _Transformer()
    if name == "padded_encoder":
        return _PaddedEncoder()
    if name == "plain":
        return nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 8))
    raise ValueError(name)


def auto_wrap_of(key):
    return {"module": "module", "children": "children",
            "linear": {nn.Linear},
            "layer": {nn.TransformerEncoderLayer},
            "layers": {nn.TransformerEncoderLayer, nn.TransformerDecoderLayer},
            "size": functools.partial(shardd.nn.size_based_auto_wrap_policy,
                                      min_num_params=100)}[key]


def batch(name, k, rank, world):
    g = torch.Generator().manual_seed(100 + k)
    if name in ("bag", "sparse", "padding", "max_norm"):
        x = torch.randint(0, 32, (ROWS, 5), generator=g)
    elif name in ("mha", "encoder", "lstm", "gru", "rnn", "transformer",
                  "padded_encoder"):
        x = torch.randn(ROWS, 6, 16, generator=g)
    else:
        x = torch.randn(ROWS, 16, generator=g)
    y = torch.randn(ROWS, 8, generator=g)
    if name in ("mha", "encoder", "lstm", "gru", "rnn", "padded_encoder"):
        y = torch.randn(ROWS, 6, 8, generator=g)
    if name == "transformer":
        y = torch.randn(ROWS, 4, 8, generator=g)
    per = ROWS // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def loss_of(model, x, y):
    return F.mse_loss(model(x), y)


def reference(name):
    """-> (state dict after STEPS steps, losses, eval output)."""
    torch.set_num_threads(1)
    model = make_model(name)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses = []
    # each rank's buffers are its own (spectral_norm's power iteration,
    # BatchNorm's statistics), as under data parallelism
    bufs = [{k: v.clone() for k, v in model.named_buffers()} for _ in range(WORLD)]
    for s in range(STEPS):
        model.step = s
        opt.zero_grad()
        params = list(model.parameters())
        kept = [p.grad for p in params]
        total = [None] * len(params)
        step_losses = []
        for r in range(WORLD):
            for p in params:
                p.grad = None
            with torch.no_grad():
                for k, v in model.named_buffers():
                    v.copy_(bufs[r][k])
            loss = loss_of(model, *batch(name, s, r, WORLD))
            loss.backward()
            with torch.no_grad():
                for k, v in model.named_buffers():
                    bufs[r][k].copy_(v)
            step_losses.append(loss.item())
            for i, p in enumerate(params):
                if p.grad is not None:
                    g = p.grad.to_dense()
                    total[i] = g if total[i] is None else total[i] + g
        for p, t, held in zip(params, total, kept):
            # no rank's backward reached it: torch's zeroed .grad (or None) stays
            p.grad = held if t is None else t / WORLD
        opt.step()
        losses.append(sum(step_losses) / WORLD)
    with torch.no_grad():  # rank 0's buffers: its eval output is compared
        for k, v in model.named_buffers():
            v.copy_(bufs[0][k])
    return ({k: v.detach().clone() for k, v in model.state_dict().items()}, losses,
            eval_output(name, model))


def eval_output(name, model):
    """Eval mode under no_grad (the encoder's fast path)."""
    model.eval()
    try:
        with torch.no_grad():
            return model(batch(name, 99, 0, 1)[0]).detach().clone()
    finally:
        model.train()


def rank_main(rank, world, sock, job, name, wraps, transient, q):
    try:
        torch.set_num_threads(1)
        for key in wraps:
            client = shardd.Client(sock, job="%s-%s" % (job, key), rank=rank, world=world,
                                   transient_areas=transient,
                                   client_name="test_builtin_modules rank %d" % rank)
            model = make_model(name)
            try:
                sm = shardd.nn.ShardedModule(client, model, auto_wrap=auto_wrap_of(key))
            except ValueError as e:
                q.put(("refused", rank, key, str(e)))
                client.close()
                continue
            if transient:
                opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
            else:
                opt = shardd.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
            for s in range(STEPS):
                model.step = s
                if not transient:  # resident: the explicit loop
                    sm.gather()
                opt.zero_grad()
                loss = loss_of(model, *batch(name, s, rank, world))
                loss.backward()
                if not transient:
                    sm.scatter()
                opt.step()
                q.put(("loss", rank, key, s, loss.item()))
            if not transient:
                sm.gather()
            out = eval_output(name, model)
            sd = model.state_dict()  # collective
            if rank == 0:
                q.put(("state", key, {k: v.detach().numpy().copy() for k, v in sd.items()},
                       out.numpy().copy()))
            client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


def rank_assign(rank, world, sock, job, transient, q):
    """An assignment through a parametrization after wrapping
    (``model.a.weight = W``: orthogonal's right_inverse sets the original's
    data) -> what the next forward says."""
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=world, transient_areas=transient)
        model = make_model("orthogonal")
        sm = shardd.nn.ShardedModule(client, model, auto_wrap="children")
        with torch.no_grad():
            model.a.weight = torch.eye(16)
        try:
            if not transient:
                sm.gather()
            model(batch("orthogonal", 0, rank, world)[0])
            q.put(("said", rank, None))
        except RuntimeError as e:
            q.put(("said", rank, str(e)))
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


def run(name, wraps, transient):
    job = common.job("builtin")
    sock = common.socket()
    out = {"losses": {}, "state": {}, "refused": {}}

    def on_msg(msg):
        if msg[0] == "loss":
            _, r, key, s, v = msg
            out["losses"].setdefault(key, {}).setdefault(s, {})[r] = v
        elif msg[0] == "state":
            out["state"][msg[1]] = (msg[2], msg[3])
        elif msg[0] == "refused":
            out["refused"].setdefault(msg[2], {})[msg[1]] = msg[3]

    common.launch_ranks(rank_main, lambda r, q: (r, WORLD, sock, job, name, wraps, transient, q),
                        WORLD, on_msg, 180)
    return out


def rel(a, b):
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class BuiltinModulesTest(unittest.TestCase):

    def check(self, name, wraps, kinds=(True, False)):
        want, want_losses, want_out = reference(name)
        for transient in kinds:
            got = run(name, wraps, transient)
            for key in wraps:
                label = "%s, auto_wrap %s, %s" % (name, key,
                                                  "transient" if transient else "resident")
                self.assertNotIn(key, got["refused"], label)
                losses = [sum(got["losses"][key][s].values()) / WORLD for s in range(STEPS)]
                for a, b in zip(losses, want_losses):
                    self.assertLessEqual(abs(a - b) / abs(b), TOL, "%s: losses %s, torch %s"
                                         % (label, losses, want_losses))
                sd, out = got["state"][key]
                self.assertEqual(sorted(sd), sorted(want), label)
                for k, v in want.items():
                    if not v.is_floating_point() or k not in dict(make_model(name).named_parameters()):
                        continue
                    self.assertLessEqual(rel(sd[k], v), TOL, "%s: %s" % (label, k))
                self.assertLessEqual(rel(out, want_out), TOL, "%s: eval output" % label)

    def test_plain(self):
        self.check("plain", ("module", "children"))

    def test_multihead_attention_out_proj_read_by_its_parent(self):
        self.check("mha", ("module", "children", "linear", "size"))

    def test_transformer_encoder_and_its_eval_fast_path(self):
        self.check("encoder", ("children", "layer", "linear", "size"), kinds=(True,))
        self.check("encoder", ("children", "layer", "linear", "size"), kinds=(False,))

    def test_transformer_encoder_nested_tensor_fast_path(self):
        self.check("padded_encoder", ("children", "layer"))

    def test_lstm_flat_weights(self):
        self.check("lstm", ("module", "children"))

    def test_gru_and_rnn_flat_weights(self):
        self.check("gru", ("module", "children"))
        self.check("rnn", ("children",), kinds=(True,))

    def test_weight_norm_pre_hook(self):
        self.check("weight_norm", ("module", "children", "linear"))

    def test_spectral_norm_pre_hook(self):
        self.check("spectral_norm", ("module", "children"))

    def test_parametrizations(self):
        self.check("orthogonal", ("module", "children", "linear"))
        self.check("parametrize", ("module", "children"))

    def test_embeddings_sparse_bag_padding(self):
        self.check("sparse", ("module", "children"))
        self.check("bag", ("module", "children"))
        self.check("padding", ("children",), kinds=(True,))

    def test_parent_reads_an_untied_child_weight_and_a_branch_skipped(self):
        self.check("untied", ("module", "children", "linear"))

    def test_weight_norm_and_spectral_norm_on_the_root(self):
        self.check("root_weight_norm", ("module",))
        self.check("root_spectral_norm", ("module",))

    def test_batchnorm_cumulative_and_untracked_statistics(self):
        self.check("batchnorm", ("module", "children"))

    def test_transformer_encoder_decoder(self):
        self.check("transformer", ("children", "layers", "linear"), kinds=(True,))
        self.check("transformer", ("layers", "linear", "size"), kinds=(False,))

    def refused(self, name, words):
        for transient in (True, False):
            got = run(name, ("module", "children"), transient)
            for key in ("module", "children"):
                for r in range(WORLD):
                    msg = got["refused"].get(key, {}).get(r, "")
                    for w in words:
                        self.assertIn(w, msg, "%s, %s, rank %d" % (name, key, r))

    def test_embedding_max_norm_is_refused(self):
        self.refused("max_norm", ("max_norm", "'emb'"))

    def test_assignment_through_a_parametrization_is_refused(self):
        for transient in (True, False):
            said = {}
            job = common.job("assign")
            sock = common.socket()
            common.launch_ranks(rank_assign, lambda r, q: (r, WORLD, sock, job, transient, q),
                                WORLD, lambda m: said.__setitem__(m[1], m[2]), 120)
            for r in range(WORLD):
                self.assertIn("'a.parametrizations.weight.original'", said[r] or "",
                              "transient" if transient else "resident")

    def test_lazy_module_not_run_is_refused(self):
        self.refused("lazy", ("'0'", "LazyLinear", "uninitialized"))


if __name__ == "__main__":
    unittest.main()
