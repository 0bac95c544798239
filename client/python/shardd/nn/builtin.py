"""torch's built-in modules that read a child's parameters outside the
child's forward, keep references to their parameter objects, or write
their parameters during forward: what the wrapper must know of them.

* nn.MultiheadAttention's forward passes ``self.out_proj.weight`` / ``.bias``
  to F.multi_head_attention_forward; out_proj's own forward never runs. A
  unit of out_proj alone (auto_wrap={nn.Linear}: it is a Linear subclass;
  a size policy) would be gathered only by the read of its weight, held
  until the root's forward ends, and with transient areas the next unit's
  gather runs out of leases. As FSDP's size policy treats the attention as
  a leaf (force_leaf_modules), out_proj is never a unit of its own: its
  parameters are its attention's unit's (or that unit's parent's).
* nn.TransformerEncoderLayer in eval mode (torch 1.13's fast path, under
  no_grad) reads every weight of its children itself and hands them to
  torch._transformer_encoder_layer_fwd; outside no_grad it reads them to
  ask whether they require grad. So no module inside it is a unit of its
  own either (the layer is, auto_wrap={nn.TransformerEncoderLayer}, or
  its parent's unit holds them).
* nn.RNNBase (LSTM, GRU, RNN) computes with ``self._flat_weights``, a list
  of its parameter objects that only its own ``__setattr__`` and ``_apply``
  refresh: the wrapper puts its parameters into ``_parameters`` directly,
  so the list is made again from them (their ``.data`` moves between the
  shard and the gather area later, which the list follows).
* nn.Embedding / nn.EmbeddingBag with ``max_norm`` renormalize the rows
  they look up *in place* during forward (torch.embedding_renorm_): a
  write into the gathered copy, which a transient unit maps read-only
  (the process would die of SIGSEGV) and a resident one overwrites at the
  next gather; and each rank would renormalize the rows of its own batch
  only. Refused at wrapping, naming the module.
* a lazy module (nn.LazyLinear...) not run yet has parameters with no
  shape to flatten: refused at wrapping, naming it.
* weight_norm and spectral_norm (and any forward pre-hook registered before
  wrapping) compute ``weight`` from the module's parameters in a forward
  pre-hook: torch runs pre-hooks in registration order, so the transient
  wrapper's gather would come after theirs, which would compute from the
  1-D parts of the shard. The wrapper's pre-hooks go first on every module
  it hooks (torch 1.13 has no ``prepend=``).
"""
import contextlib

from torch import nn


def leaf_children(module):
    """-> ids of the modules whose parameters an ancestor's forward reads
    itself (never units of their own): every MultiheadAttention's
    out_proj, and every module inside a TransformerEncoderLayer."""
    out = set()
    for m in module.modules():
        if isinstance(m, nn.MultiheadAttention) and isinstance(
                getattr(m, "out_proj", None), nn.Module):
            out.add(id(m.out_proj))
        elif isinstance(m, nn.TransformerEncoderLayer):
            out.update(id(c) for c in m.modules() if c is not m)
    return out


def check_builtin(module):
    """Refuses the built-in modules the wrapper cannot train as torch does
    (ValueError naming the module and why)."""
    for name, m in module.named_modules():
        lazy = [k for k, t in list(m._parameters.items()) + list(m._buffers.items())
                if isinstance(t, nn.parameter.UninitializedTensorMixin)]
        if lazy:
            raise ValueError(
                "module %r (%s) has uninitialized (lazy) %s: their shapes are made by "
                "its first forward; run a forward with a dummy batch before wrapping"
                % (name or "<root>", type(m).__name__, ", ".join(lazy)))
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None:
            raise ValueError(
                "module %r (%s, max_norm=%r) renormalizes the rows it looks up in its "
                "weight in place during forward: under the wrapper that writes the "
                "gathered copy (read-only with transient areas, overwritten by the next "
                "gather with resident ones), and each rank would renormalize only its "
                "own batch's rows; use max_norm=None (or renormalize the weight "
                "yourself outside forward)" % (name or "<root>", type(m).__name__,
                                               m.max_norm))


def refresh_cached(module):
    """After the wrapper replaced parameters in modules' ``_parameters``:
    every RNN's ``_flat_weights`` made again from its parameters (the list
    its forward computes with, refreshed by torch only on setattr)."""
    for m in module.modules():
        if isinstance(m, nn.RNNBase):
            m._flat_weights = [m._parameters.get(wn) for wn in m._flat_weights_names]


def put_parameter(m, attr, t):
    """t is m's parameter attr now (in ``_parameters``, as the wrapper's
    swaps put it, without setattr's checks), and an RNN's
    ``_flat_weights`` made again from its parameters, as refresh_cached."""
    m._parameters[attr] = t
    names = getattr(m, "_flat_weights_names", None)
    if names is not None:
        m._flat_weights = [m._parameters.get(wn) for wn in names]


@contextlib.contextmanager
def pre_hooks_first(modules):
    """The forward pre-hooks registered on `modules` inside the block run
    before those registered earlier (in the order registered), so that a
    unit is gathered before a hook of the script's (weight_norm's) reads
    its parameters."""
    before = {id(m): set(m._forward_pre_hooks) for m in modules}
    yield
    for m in modules:
        new = [k for k in m._forward_pre_hooks if k not in before[id(m)]]
        for k in reversed(new):
            m._forward_pre_hooks.move_to_end(k, last=False)
