"""Model families and training habits beyond nanoGPT / LLaMA / ResNet,
through shardd.nn on 2 and 3 ranks (3: shard boundaries inside
parameters), against one process of torch on the ranks' batches:

* LoRA as PEFT makes it: nanoGPT's weights frozen, a LoRALinear (the base
  Linear inside it) per attention and MLP Linear, a unit per Block, the
  optimizer over ``filter(lambda p: p.requires_grad, ...)``, the adapters'
  state dict (``"lora_" in key``) and the merged weights (``W + B @ A *
  scale`` from ``sm.full_parameters()``, FSDP's summon_full_params) that
  plain nanoGPT loads (that merge from the parts, outside forward, is
  refused naming the parameter); a unit per Block, and per adapter;
* ViT as timm's: bare ``cls_token`` / ``pos_embed`` on the root and layer
  scale ``gamma_1`` / ``gamma_2`` in each Block, a Conv2d patch embedding,
  the cls token torch.cat'ed before the patches, trunc_normal_ init, and
  the no-decay groups built from ``named_parameters()`` after wrapping
  (``p.ndim <= 1``, biases, ``no_weight_decay()``'s names);
* T5: the relative position bias owned by the first Block of each stack
  and handed to every later Block (a tensor of one unit used by others),
  an encoder-decoder whose decoder Blocks cross-attend to the encoder's
  output, the embedding shared by both stacks and tied to the head (or the
  bias module held by every Block); greedy generation after each step
  calling the encoder, decoder and head itself under no_grad, as HF's
  generate() does (with grad enabled that call is refused);
* MoE: top-2 routing over 4 experts (each used on every rank), the
  load-balancing loss added to the loss, gradients accumulated over 2
  micro-batches (the first under no_sync() too); a unit per Block, and
  per expert.

Every run has these habits: ``torch.manual_seed(seed + rank)`` for the
dropout masks (the reference draws each rank's masks from that rank's
generator, as DDP's ranks do), ``zero_grad(set_to_none=False)``, a warmup
LambdaLR, torch's ``clip_grad_norm_`` over the optimizer's param groups,
and a validation under ``model.eval()`` + ``torch.no_grad()`` between
steps; with torch.optim.AdamW built after wrapping and with
shardd.optim.AdamW, and on resident clients (the gradients reduced by
sm.scatter(), accumulated per rank before it as autograd does)."""
import contextlib
import unittest

import common
import shardd

if common.HAVE_TORCH:
    import torch
    import torch.nn.functional as F
    import models
    import shardd.nn
    import shardd.optim
    import test_torch_optim as tto

STEPS = 4
ROWS = 2           # rows per rank and micro-batch
SEED = 1234        # torch.manual_seed(SEED + rank) for the dropout masks
CLIP = 0.5
WD = 0.05
TOL = 1e-5         # per tensor max |a - b| / max |b|, losses relative
# T5: the wrapped run's gradients differ from torch's in the last bits (the
# sums over the decoder's cross-attention reads of the encoder's output and
# over the shared embedding's three uses come in another order: with SGD
# the parameters are within 1.0e-7 after 4 steps), which AdamW's first
# steps (update ~ lr * g / |g|) make 3e-5 where a gradient is near zero
# (the encoder's dead ReLU rows of wi)
T5_TOL = 1e-4


def warmup(s):
    return min(1.0, (s + 1) / 3)


# ---- the families: model, units, optimizer groups, loss ---------------------

def gpt_loss(model, k, r, world, rows=ROWS):
    x, y = models.gpt_batch(models.GPTConfig(), k, r, world, rows=rows)
    return models.gpt_loss(model, x, y)


def moe_loss(model, k, r, world):
    loss = gpt_loss(model, k, r, world, rows=4 * ROWS) + 0.01 * models.moe_aux(model)
    if torch.is_grad_enabled():  # training: each rank's rows reach every expert
        least = min(m.least for m in model.modules() if isinstance(m, models.TopKMoE))
        assert least > 0, "an expert no token of rank %d reached at micro-batch %d" % (r, k)
    return loss


def vit_loss(model, k, r, world):
    x, y = models.image_batch(k, r, world, rows=ROWS, size=16)
    return F.cross_entropy(model(x), y)


def t5_loss(model, k, r, world):
    src, tgt_in, tgt = models.seq2seq_batch(k, r, world, rows=ROWS)
    logits = model(src, tgt_in)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))


def t5_generate(model, steps=5):
    """Greedy decoding as HF's generate() runs it: the encoder called
    once, then the decoder and the head called directly (never the root's
    forward), a token at a time; -> the tokens and each step's top logit."""
    src, _, _ = models.seq2seq_batch(1000, rows=ROWS)
    enc = model.encoder(src)
    tgt, tops = torch.zeros(src.shape[0], 1, dtype=torch.long), []
    for _ in range(steps):
        logits = model.lm_head(model.decoder(tgt, enc)[:, -1] * model.dim ** -0.5)
        top, nxt = logits.max(-1)
        tops.append(top)
        tgt = torch.cat((tgt, nxt[:, None]), 1)
    return tgt[:, 1:].tolist(), torch.stack(tops).tolist()


def trainable_groups(model):
    return [{"params": list(filter(lambda p: p.requires_grad, model.parameters())),
             "weight_decay": WD}]


def decay_groups(model):
    return [{"params": list(model.parameters()), "weight_decay": WD}]


def vit_init(model):
    """timm's VisionTransformer.init_weights, run after wrapping (every
    rank the same seed): draws over the root's bare 3-D parameters, the
    4-D patch kernel and every Linear."""
    torch.manual_seed(7)
    torch.nn.init.trunc_normal_(model.pos_embed, std=0.02)
    torch.nn.init.normal_(model.cls_token, std=1e-6)
    torch.nn.init.trunc_normal_(model.patch_embed.proj.weight, std=0.02)
    model.apply(models.ViT._init_weights)


REINIT = {"vit_init_after": vit_init}  # family: run after wrapping (the reference: building)


def trainable_leaves(module, recurse, nonwrapped_numel):
    """HF accelerate's policy for PEFT under FSDP (its lambda_policy_fn):
    a unit per leaf module whose weight trains (each lora_A, lora_B)."""
    if recurse:
        return True
    w = getattr(module, "weight", None)
    return (not list(module.children()) and isinstance(w, torch.Tensor)
            and w.requires_grad)


def experts(module, recurse, nonwrapped_numel):
    """A unit per expert."""
    return True if recurse else (isinstance(module, torch.nn.Sequential)
                                 and isinstance(module[0], torch.nn.Linear))


FAMILIES = {
    # name: (build, auto_wrap, groups, loss, micro-batches)
    "lora": (models.lora_gpt, lambda: {models.Block}, trainable_groups, gpt_loss, 1),
    # the optimizer over every parameter, the frozen ones too (no .grad: skipped)
    "lora_all": (models.lora_gpt, lambda: {models.Block}, decay_groups, gpt_loss, 1),
    "lora_leaves": (models.lora_gpt, lambda: trainable_leaves, trainable_groups, gpt_loss, 1),
    "vit": (models.vit, lambda: {models.ViTBlock},
            lambda m: models.vit_param_groups(m, WD), vit_loss, 1),
    "vit_init_after": (models.vit, lambda: {models.ViTBlock},
                       lambda m: models.vit_param_groups(m, WD), vit_loss, 1),
    "vit_children": (models.vit, lambda: "children",
                     lambda m: models.vit_param_groups(m, WD), vit_loss, 1),
    "t5": (models.t5, lambda: {models.T5Block}, decay_groups, t5_loss, 1),
    "t5_shared_bias": (lambda: models.t5(shared_bias=True), lambda: {models.T5Block},
                       decay_groups, t5_loss, 1),
    "moe": (models.moe_gpt, lambda: {models.MoEBlock}, decay_groups, moe_loss, 2),
    "moe_experts": (models.moe_gpt, lambda: experts, decay_groups, moe_loss, 2),
    # the first micro-batch's backward under sm.no_sync() (the reference's as any)
    "moe_no_sync": (models.moe_gpt, lambda: {models.MoEBlock}, decay_groups, moe_loss, 2),
}


def make_opt(kind, groups):
    mine = kind in ("shardd", "resident")
    cls = shardd.optim.AdamW if mine else torch.optim.AdamW
    extra = {} if mine else {"foreach": False}
    return cls(groups, lr=3e-3, betas=(0.9, 0.99), eps=1e-8, **extra)


def backward(loss_fn, model, k, ranks, world, rngs, local=None):
    """Micro-batch k's backward; -> the loss (the ranks' mean). A rank
    (rngs None) runs its own; the reference (rngs: each rank's generator
    state) each rank's from zero under that rank's generator, their sum in
    rank order over world added to the .grad kept, as the daemon's
    reduce-scatter adds the ranks' mean to the reduced gradient; or, for a
    resident client's (local: {rank: its gradients}), each rank's added to
    its own, as autograd accumulates them until sm.scatter()."""
    if rngs is None:
        loss = loss_fn(model, k, ranks[0], world)
        loss.backward()
        return loss.item()
    params = [p for p in model.parameters() if p.requires_grad]
    kept = [p.grad for p in params]
    total, losses = [torch.zeros_like(p) for p in params], []
    for r in ranks:
        for i, p in enumerate(params):
            p.grad = None if local is None else local.setdefault(r, {}).get(i)
        torch.set_rng_state(rngs[r])
        loss = loss_fn(model, k, r, world)
        rngs[r] = torch.get_rng_state()
        loss.backward()
        losses.append(loss.item())
        if local is not None:
            local[r] = {i: p.grad for i, p in enumerate(params) if p.grad is not None}
        for t, p in zip(total, params):
            if p.grad is not None:
                t += p.grad
    if local is not None:
        for p, held in zip(params, kept):
            p.grad = held
        return sum(losses) / world
    for p, held, t in zip(params, kept, total):
        p.grad = t / world if held is None else held + t / world
    return sum(losses) / world


def scattered(model, local, world):
    """The reference's sm.scatter("mean") of the ranks' gradients (local)."""
    params = [p for p in model.parameters() if p.requires_grad]
    for i, p in enumerate(params):
        t = sum(local[r].get(i, torch.zeros_like(p)) for r in sorted(local)) / world
        p.grad = t if p.grad is None else p.grad + t
    local.clear()


def train(family, model, opt, ranks, world, rngs=None, sm=None, resident=False):
    """The loop every rank (ranks [rank], sm its wrapper) and the
    reference (every rank) run; -> (losses, validation losses, clip_grad_norm_'s
    norms)."""
    _, _, _, loss_fn, micro = FAMILIES[family]

    def sync(m):
        quiet = sm is not None and family.endswith("no_sync") and m < micro - 1
        return sm.no_sync() if quiet else contextlib.nullcontext()

    # a resident client's loop (FSDP's SHARD_GRAD_OP): the gradients
    # reduced by sm.scatter(), the parameters gathered again after the step
    resident = resident or (sm is not None and not sm.transient)
    local = {} if resident and sm is None else None
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    losses, evals, norms, gens = [], [], [], []
    for s in range(STEPS):
        opt.zero_grad(set_to_none=False)
        total = 0.0
        for m in range(micro):
            with sync(m):
                total += backward(loss_fn, model, s * micro + m, ranks, world, rngs, local)
        losses.append(total / micro)
        params = [p for g in opt.param_groups for p in g["params"]]
        if resident and sm is not None:
            sm.scatter("mean")
            norms.append(float(sm.clip_grad_norm_(CLIP)))
        elif rngs is None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, CLIP)))
        else:  # torch's, its sums in double as the wrapper's all-reduced norm
            if local is not None:
                scattered(model, local, world)
            norms.append(float(tto.clip_norm64(params, CLIP)))
        opt.step()
        sched.step()
        if resident and sm is not None:
            sm.gather()
        model.eval()
        with torch.no_grad():
            evals.append(loss_fn(model, 1000 + s, 0, 1).item())  # the same rows everywhere
            if family.startswith("t5"):
                gens.append(t5_generate(model))
        model.train()
    return losses, evals, norms, gens


def lora_outputs(model, full):
    """The adapters' state dict and the merged weights (plain nanoGPT's
    names) from every parameter whole (`full`)."""
    adapters = {k: v for k, v in full.items() if "lora_" in k}
    return adapters, models.merge_lora(model, full)


def rank_main(rank, world, sock, job, family, kind, q):
    try:
        torch.set_num_threads(1)
        build, auto_wrap, groups, _, _ = FAMILIES[family]
        client = shardd.Client(sock, job=job, rank=rank, world=world,
                               transient_areas=kind != "resident",
                               client_name="test_model_families rank %d" % rank)
        model = build()
        sm = shardd.nn.ShardedModule(client, model, auto_wrap=auto_wrap())
        REINIT.get(family, lambda m: None)(model)
        opt = make_opt(kind, groups(model))
        torch.manual_seed(SEED + rank)
        q.put(("losses", rank, train(family, model, opt, [rank], world, sm=sm)))
        full = sm.full_parameters()  # collective
        sd = model.state_dict()      # collective
        # torch's state dict of the untrained model loads back (every name
        # of a shared module's parameter too)
        model.load_state_dict(build().state_dict())
        loaded = sm.full_parameters()
        fresh = dict(build().named_parameters())
        q.put(("loaded", rank, sorted(n for n, t in loaded.items()
                                      if not torch.equal(t, fresh[n].detach()))))
        if family == "lora":  # PEFT's set_peft_model_state_dict: the adapters alone
            adapters = {n: t for n, t in sd.items() if "lora_" in n}
            keys = model.load_state_dict(adapters, strict=False)
            now = sm.full_parameters()
            q.put(("adapters loaded", rank, (
                sorted(n for n, t in now.items() if not torch.equal(
                    t, adapters[n] if n in adapters else fresh[n].detach())),
                sorted(keys.missing_keys) == sorted(set(sd) - set(adapters)),
                keys.unexpected_keys)))
        if rank == 0:
            q.put(("params", {n: t.numpy().copy() for n, t in full.items()}))
            q.put(("state", rank, {n: t.numpy().copy() for n, t in sd.items()}))
            if family == "lora":
                adapters, merged = lora_outputs(model, full)
                q.put(("lora", rank, ({n: t.numpy().copy() for n, t in adapters.items()},
                                      {n: t.numpy().copy() for n, t in merged.items()})))
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


MERGES = {  # a LoRA merge written as under summon_full_params, from the parts
    "B @ A": lambda m: m.lora_B.weight @ m.lora_A.weight,
    "torch.matmul": lambda m: torch.matmul(m.lora_B.weight, m.lora_A.weight),
    "torch.mm of .data": lambda m: torch.mm(m.lora_B.weight.data, m.lora_A.weight.data),
    "Tensor.matmul": lambda m: m.lora_B.weight.detach().matmul(m.lora_A.weight),
}


def merge_rank(rank, world, sock, job, q):
    """The merge outside forward, where every parameter is this rank's 1-D
    part: each way refused, the base weight untouched."""
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=world, transient_areas=True,
                               client_name="test_model_families merge rank %d" % rank)
        model = models.lora_gpt()
        sm = shardd.nn.ShardedModule(client, model, auto_wrap={models.Block})
        lora = model.transformer.h[0].attn.c_attn
        errs = {}
        for how, product in MERGES.items():
            try:
                with torch.no_grad():
                    lora.base.weight += product(lora) * lora.scale
                errs[how] = None
            except RuntimeError as e:
                errs[how] = str(e)
        q.put(("errs", rank, errs))
        common.send_params(rank, q, sm)
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


def encoder_with_grad_rank(rank, world, sock, job, q):
    """model.encoder called with grad enabled outside the model's forward
    (training the encoder alone): its embedding is the root unit's."""
    try:
        torch.set_num_threads(1)
        client = shardd.Client(sock, job=job, rank=rank, world=world, transient_areas=True,
                               client_name="test_model_families encoder rank %d" % rank)
        model = models.t5()
        shardd.nn.ShardedModule(client, model, auto_wrap={models.T5Block})
        src, _, _ = models.seq2seq_batch(0, rank, world, rows=ROWS)
        try:
            model.encoder(src)
            err = None
        except shardd.Error as e:
            err = (e.code_name, e.message)
        q.put(("err", rank, err))
        with torch.no_grad():  # the same call under no_grad is gathered
            q.put(("shape", rank, tuple(model.encoder(src).shape)))
        client.close()
        q.put(("done", rank))
    except BaseException as e:
        common.rank_failed(rank, q, e)


def reference(family, world, kind="torch"):
    build, _, groups, _, _ = FAMILIES[family]
    model = build()
    REINIT.get(family, lambda m: None)(model)
    opt = make_opt("torch", groups(model))
    rngs = {}
    for r in range(world):
        torch.manual_seed(SEED + r)
        rngs[r] = torch.get_rng_state()
    return (model,) + train(family, model, opt, list(range(world)), world, rngs,
                            resident=kind == "resident")


@unittest.skipUnless(common.HAVE_TORCH, "torch is not importable")
class ModelFamiliesTest(unittest.TestCase):

    def check(self, family, world=2, kind="torch"):
        torch.set_num_threads(1)
        ref, want_losses, want_evals, want_norms, want_gens = reference(family, world, kind)
        job, sock = common.job("family"), common.socket()
        got = common.launch_collect(rank_main, lambda r, q: (r, world, sock, job, family, kind, q),
                                    world, timeout=150)
        losses = [sum(got[("losses", r)][0][s] for r in range(world)) / world
                  for s in range(STEPS)]
        what = "%s, %d ranks, %s optimizer" % (family, world, kind)
        tol = T5_TOL if family.startswith("t5") else TOL
        for r in range(world):
            self.assertEqual(got[("loaded", r)], [], "not loaded on rank %d (%s)" % (r, what))
        for s in range(STEPS):
            self.assertLessEqual(abs(losses[s] - want_losses[s]), TOL * abs(want_losses[s]),
                                 "step %d loss (%s)" % (s, what))
            for r in range(world):  # every rank's validation and norm are torch's
                ev, norm = got[("losses", r)][1][s], got[("losses", r)][2][s]
                self.assertLessEqual(abs(ev - want_evals[s]), TOL * abs(want_evals[s]),
                                     "step %d validation on rank %d (%s)" % (s, r, what))
                self.assertLessEqual(abs(norm - want_norms[s]), TOL * abs(want_norms[s]),
                                     "step %d gradient norm on rank %d (%s)" % (s, r, what))
                for (toks, tops), (want_toks, want_tops) in zip(got[("losses", r)][3][s:s + 1],
                                                                want_gens[s:s + 1]):
                    self.assertEqual(toks, want_toks, "step %d generation (%s)" % (s, what))
                    self.assertLessEqual(common.max_rel(tops, want_tops), TOL, what)
        start = dict(FAMILIES[family][0]().named_parameters())
        for n, p in ref.named_parameters():
            self.assertLessEqual(common.max_rel(got["params"][n], p.detach().numpy()), tol,
                                 "%s (%s)" % (n, what))
            moved = not torch.equal(torch.from_numpy(got["params"][n]), start[n].detach())
            self.assertEqual(moved, p.requires_grad, "%s trained: %s (%s)" % (n, moved, what))
        want_sd = ref.state_dict()
        self.assertEqual(list(got[("state", 0)]), list(want_sd), what)
        for n, t in want_sd.items():
            self.assertEqual(got[("state", 0)][n].shape, tuple(t.shape), "%s (%s)" % (n, what))
            self.assertLessEqual(common.max_rel(got[("state", 0)][n], t.numpy()), tol, n)
        return ref, got

    # LoRA / PEFT
    def check_lora(self, world, kind):
        ref, got = self.check("lora", world, kind)
        adapters, merged = got[("lora", 0)]
        for r in range(world):  # the adapters loaded alone, the base kept
            self.assertEqual(got[("adapters loaded", r)], ([], True, []), "rank %d" % r)
        want_adapters, want_merged = lora_outputs(ref, {n: p.detach() for n, p
                                                        in ref.named_parameters()})
        self.assertEqual(sorted(adapters), sorted(want_adapters))
        self.assertEqual(len(adapters), 4 * 2 * 2)  # 4 Linears x 2 Blocks x A, B
        for n, t in want_adapters.items():
            self.assertLessEqual(common.max_rel(adapters[n], t.numpy()), TOL, n)
        plain = models.nano_gpt()  # the merged weights are plain nanoGPT's
        missing, unexpected = plain.load_state_dict(
            {n: torch.from_numpy(t) for n, t in merged.items()}, strict=False)
        self.assertEqual(unexpected, [])
        self.assertEqual(missing, ["lm_head.weight"] if "lm_head.weight" not in merged else [])
        for n, t in want_merged.items():
            self.assertLessEqual(common.max_rel(merged[n], t.numpy()), TOL, n)

    def test_lora_adapters_on_a_frozen_gpt_train_and_merge_as_torch(self):
        self.check_lora(2, "torch")

    def test_lora_adapters_on_three_ranks_with_shardd_optim(self):
        self.check_lora(3, "shardd")

    def test_a_lora_merge_from_the_parts_is_refused_naming_the_parameter(self):
        # B @ A of two 1-D parts is their dot product (a rank with empty
        # parts: 0), which += added to every element of the base's part
        # without a word where the parts' lengths agreed
        job, sock = common.job("merge"), common.socket()
        got = common.launch_collect(merge_rank, lambda r, q: (r, 2, sock, job, q), 2)
        for r in range(2):
            for how, err in got[("errs", r)].items():
                self.assertIsNotNone(err, "%s on rank %d" % (how, r))
                self.assertIn("'transformer.h.0.attn.c_attn.lora_B.weight'", err, how)
                self.assertIn("sm.full_parameters()", err, how)
        want = models.lora_gpt().transformer.h[0].attn.c_attn.base.weight
        self.assertTrue(torch.equal(torch.from_numpy(
            got["params"]["transformer.h.0.attn.c_attn.base.weight"]), want.detach()))

    def test_lora_with_the_optimizer_over_every_parameter_trains_as_torch(self):
        self.check("lora_all", 3, "shardd")
        self.check("lora_all", 2, "torch")

    def test_lora_with_a_unit_per_adapter_trains_as_torch(self):
        self.check("lora_leaves", 2, "torch")

    # ViT
    def test_vit_with_bare_parameters_and_no_decay_groups_trains_as_torch(self):
        self.check("vit", 2, "torch")

    def test_vit_initialized_after_wrapping_on_three_ranks_trains_as_torch(self):
        self.check("vit_init_after", 3, "torch")

    def test_vit_unit_per_child_on_three_ranks_trains_as_torch(self):
        self.check("vit_children", 3, "torch")

    def test_vit_with_shardd_optim_trains_as_torch(self):
        self.check("vit", 2, "shardd")

    # T5
    def test_t5_shared_position_bias_and_cross_attention_train_as_torch(self):
        self.check("t5", 2, "torch")

    def test_t5_on_three_ranks_with_shardd_optim(self):
        self.check("t5", 3, "shardd")

    def test_t5_encoder_called_alone_with_grad_is_refused_naming_the_embedding(self):
        job, sock = common.job("encoder"), common.socket()
        got = common.launch_collect(encoder_with_grad_rank, lambda r, q: (r, 2, sock, job, q), 2)
        for r in range(2):
            code, msg = got[("err", r)]
            self.assertEqual(code, "E_STATE")
            self.assertIn("'shared.weight' of the root's unit", msg)
            self.assertIn("torch.no_grad()", msg)
            self.assertEqual(got[("shape", r)], (ROWS, 12, 32))

    def test_t5_with_the_bias_module_held_by_every_block_trains_as_torch(self):
        self.check("t5_shared_bias", 2, "torch")

    def test_t5_with_the_bias_module_held_by_every_block_on_three_ranks(self):
        self.check("t5_shared_bias", 3, "shardd")

    # MoE
    def test_topk_moe_with_aux_loss_and_accumulation_trains_as_torch(self):
        self.check("moe", 2, "torch")

    def test_topk_moe_on_three_ranks_with_shardd_optim(self):
        self.check("moe", 3, "shardd")

    def test_topk_moe_with_a_unit_per_expert_trains_as_torch(self):
        self.check("moe_experts", 3, "torch")

    def test_topk_moe_accumulated_under_no_sync_trains_as_torch(self):
        self.check("moe_no_sync", 2, "torch")

    # a resident client (FSDP's SHARD_GRAD_OP): sm.scatter(), shardd.optim,
    # sm.clip_grad_norm_, sm.gather() after the step
    def test_resident_lora_trains_as_torch(self):
        self.check_lora(2, "resident")

    def test_resident_vit_on_three_ranks_trains_as_torch(self):
        self.check("vit", 3, "resident")

    def test_resident_t5_generates_and_trains_as_torch(self):
        self.check("t5", 2, "resident")

    def test_resident_topk_moe_accumulated_on_three_ranks_trains_as_torch(self):
        self.check("moe", 3, "resident")


if __name__ == "__main__":
    unittest.main()
