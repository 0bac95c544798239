"""FSDP-style wrapping of a torch ``nn.Module`` over shardd (use_orig_params).

    sm = shardd.nn.ShardedModule(client, model, auto_wrap="children")
    opt = sm.register_optimizer("adamw", model.parameters(), lr=1e-3)
    for batch in data:
        sm.gather()                 # all-gather every flat buffer (collective)
        loss = loss_fn(model(x), y)
        sm.zero_grad()              # zero grad areas, attach .grad views
        loss.backward()             # gradients accumulate into the grad areas
        sm.scatter("mean")          # reduce-scatter (collective)
        sm.step(opt)                # optimizer on the daemon (collective)

What the wrapper does, per *unit* (the whole module, or with
``auto_wrap="children"`` each top-level child holding parameters plus one unit
for the root's own parameters — FSDP's auto-wrap at depth 1):

* flattens the unit's parameters (``named_parameters`` order, shared
  parameters once) into one flat buffer ``<prefix><unit>.flat_param`` of the
  given dtype, and registers each original parameter as a view
  ``<prefix><qualified name>`` at its offset with its shape;
* writes this rank's shard ``[rank*s, (rank+1)*s)`` of the flattened initial
  values (every rank must build the model identically, e.g. same seed: each
  rank contributes only its own slice);
* replaces every parameter on its module(s) with a new ``nn.Parameter`` that
  is a view of the gather area (no copy: ``torch.frombuffer`` of the host
  mapping, or on the cuda backend a CUDA tensor over the daemon's GPU memory),
  so a forward after :meth:`gather` computes with the daemon's data, and the
  parameters the optimizer is registered with *are* the shardd views;
* gradients: :meth:`zero_grad` zeroes each grad area (padding included) and
  sets every parameter's ``.grad`` to the view of its slice of the grad area.
  autograd accumulates into an existing ``.grad`` in place (outside
  create_graph), so ``backward()`` writes the gradients straight into shared
  memory. If something replaced a ``.grad`` (e.g. ``zero_grad(set_to_none=True)``
  on the model after ours, or a hook), :meth:`scatter` copies it into the grad
  area first, so the result is right either way; a parameter without a
  gradient contributes zeros.

The original parameter tensors are dropped from the module; the initial
gather is done by the constructor (it is a collective: every rank of the job
must construct the same wrapper). Mapped tensors alias libshardd mappings:
don't use the module after the client is closed.

On the cuda backend the parameters and their ``.grad`` live on the GPU the
daemon put this rank's areas on (:attr:`ShardedModule.device`; the module's
buffers, e.g. BatchNorm statistics, are moved there too; inputs are the
caller's to move). The client waits for the queued GPU work
(``torch.cuda.synchronize``) before each gather, scatter and step it
requests, so the daemon reads finished gradients and shards and overwrites
no parameter a kernel still reads.
"""
import torch
from torch import nn


_TORCH_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class FlatUnit:
    """One flat buffer and the original parameters it holds."""

    def __init__(self, name, buffer, entries):
        self.name = name
        self.buffer = buffer
        self.entries = entries  # list of _Entry

    def __repr__(self):
        return "<FlatUnit %r buffer=%d numel=%d params=%d>" % (
            self.name, self.buffer.id, self.buffer.numel, len(self.entries))


class _Entry:
    __slots__ = ("name", "view", "param", "owners", "grad_view")

    def __init__(self, name, view, owners):
        self.name = name          # qualified name of the (first) occurrence
        self.view = view          # shardd.View
        self.owners = owners      # [(module, attr)] where the parameter lives
        self.param = None         # the replacement nn.Parameter (gather view)
        self.grad_view = None     # tensor view of the grad area


def _unit_modules(module, auto_wrap):
    """-> [(unit_name, [(qualified_prefix, submodule) roots])]."""
    if auto_wrap in (None, False, "module", "none"):
        return [("", module, None)]
    if auto_wrap != "children":
        raise ValueError("auto_wrap must be 'module' or 'children', not %r" % (auto_wrap,))
    units = []
    for cname, child in module.named_children():
        units.append((cname, child, cname + "."))
    units.append(("", module, ""))  # the root's own (direct) parameters
    return units


def _collect(root, qual_prefix, direct_only, seen):
    """Parameters under root (or only root's direct ones), shared ones once.
    -> [(qualified name, param, [(module, attr)])]"""
    out = []
    index = {}
    mods = [("", root)] if direct_only else list(root.named_modules(remove_duplicate=False))
    for mname, m in mods:
        for pname, p in m._parameters.items():
            if p is None:
                continue
            key = id(p)
            if key in index:
                out[index[key]][2].append((m, pname))
                continue
            if key in seen:  # already owned by an earlier unit: share its view
                seen[key][2].append((m, pname))
                continue
            qn = qual_prefix + (mname + "." if mname else "") + pname
            rec = (qn, p, [(m, pname)])
            index[key] = len(out)
            seen[key] = rec
            out.append(rec)
    return out


class ShardedModule:
    """Wraps `module` in place over the client's job; see the module docstring.

    client: a shardd.Client of this rank (job, rank, world).
    auto_wrap: "module" (one flat buffer) or "children" (one per top-level
      child with parameters, plus one for the root's direct parameters).
    prefix: prepended to buffer and view names (names are per job).
    dtype: "fp32", "bf16", "fp16" or a torch dtype; default: the parameters'
      dtype (they must all have one dtype).
    """

    def __init__(self, client, module, auto_wrap="module", prefix="", dtype=None,
                 initial_gather=True):
        self.client = client
        self.module = module
        self.prefix = prefix
        self.units = []
        self._by_param = {}       # id(replacement param) -> _Entry
        self._orig_names = {}     # id(original param) -> qualified name
        self._orig_keep = []      # keeps originals alive so their ids stay unique
        seen = {}
        rank = client.rank
        for uname, root, qp in _unit_modules(module, auto_wrap):
            direct_only = qp == "" and auto_wrap == "children"
            params = _collect(root, qp if qp is not None else "", direct_only, seen)
            if not params:
                continue
            udt = dtype
            if udt is None:
                dts = {p.dtype for _, p, _ in params}
                if len(dts) != 1:
                    raise ValueError("unit %r mixes dtypes %s; pass dtype=" % (uname or "<root>", dts))
                udt = dts.pop()
            if isinstance(udt, torch.dtype):
                if udt not in _TORCH_DTYPES:
                    raise ValueError("dtype %s is not supported by shardd" % udt)
                udt = _TORCH_DTYPES[udt]
            total = sum(p.numel() for _, p, _ in params)
            bname = "%s%s.flat_param" % (prefix, uname if uname else "root")
            buf = client.register_buffer(bname, udt, total)
            gat = buf.gather_tensor
            grd = buf.grad_tensor
            # this rank's slice of the flattened initial values
            with torch.no_grad():
                flat = torch.cat([p.detach().reshape(-1).to(gat.dtype) for _, p, _ in params])
                lo = rank * buf.shard_numel
                hi = min(lo + buf.shard_numel, total)
                sh = buf.shard_tensor
                sh.zero_()
                if hi > lo:
                    sh[:hi - lo].copy_(flat[lo:hi])
            entries = []
            off = 0
            for qn, p, owners in params:
                view = client.register_view(buf, prefix + qn, off, tuple(p.shape))
                e = _Entry(qn, view, owners)
                n = p.numel()
                newp = nn.Parameter(gat[off:off + n].view(p.shape), requires_grad=p.requires_grad)
                e.param = newp
                e.grad_view = grd[off:off + n].view(p.shape)
                self._orig_names[id(p)] = qn
                self._orig_keep.append(p)
                for m, attr in owners:
                    m._parameters[attr] = newp
                self._by_param[id(newp)] = e
                entries.append(e)
                off += n
            self.units.append(FlatUnit(uname or "root", buf, entries))
        dev = self.device
        if dev.type == "cuda":  # the forward must find the module's buffers there
            for m in module.modules():
                for k, b in m._buffers.items():
                    if b is not None and b.device != dev:
                        m._buffers[k] = b.to(dev)
        if initial_gather:
            self.gather()

    # -- introspection ---------------------------------------------------
    @property
    def buffers(self):
        return [u.buffer for u in self.units]

    @property
    def device(self):
        """Where the parameters live: cpu on the host backend, the GPU of
        this rank's areas (cuda:N) on the cuda backend."""
        for u in self.units:
            return u.buffer.gather_tensor.device
        return torch.device("cpu")

    def named_parameters(self):
        for u in self.units:
            for e in u.entries:
                yield e.name, e.param

    def parameters(self):
        for _, p in self.named_parameters():
            yield p

    def view_of(self, tensor):
        """The shardd.View a (replacement) parameter is, or None."""
        e = self._by_param.get(id(tensor))
        return e.view if e is not None else None

    # -- training loop -----------------------------------------------------
    def gather(self):
        """All-gather every unit (collective): parameters now hold the shards."""
        for u in self.units:
            self.client.gather(u.buffer)

    def zero_grad(self):
        """Zero the grad areas and point every parameter's .grad at its slice."""
        with torch.no_grad():
            for u in self.units:
                u.buffer.grad_tensor.zero_()
                for e in u.entries:
                    e.param.grad = e.grad_view

    def sync_grads(self):
        """Make the grad areas hold the current .grad of every parameter
        (copies only where autograd did not accumulate in place)."""
        with torch.no_grad():
            for u in self.units:
                for e in u.entries:
                    g = e.param.grad
                    if g is None:
                        e.grad_view.zero_()
                    elif g.data_ptr() != e.grad_view.data_ptr():
                        e.grad_view.copy_(g)
                        e.param.grad = e.grad_view

    def scatter(self, op="mean"):
        """sync_grads(), then reduce-scatter every unit (collective)."""
        self.sync_grads()
        for u in self.units:
            self.client.scatter(u.buffer, op)

    def step(self, opt, lr=None, max_norm=None):
        return self.client.step(opt, lr=lr, max_norm=max_norm)

    # -- optimizer ---------------------------------------------------------
    def param_groups(self, params=None, **defaults):
        """torch-style params (iterable of tensors, of (name, tensor) pairs, or
        of dicts with "params") -> shardd groups: every tensor becomes its
        view, named by its qualified name; a tensor this wrapper does not
        manage becomes a "not a shardd tensor" ref under the best name known
        (its name in the module, its name before wrapping, or a description),
        which the daemon refuses naming it."""
        if params is None:
            params = list(self.parameters())
        if isinstance(params, torch.Tensor):
            raise TypeError("params must be an iterable of tensors or dicts, not a tensor")
        params = list(params)
        if not params:
            raise ValueError("optimizer got an empty parameter list")
        if not isinstance(params[0], dict):
            params = [{"params": params}]
        names = {id(p): n for n, p in self.module.named_parameters()}
        groups = []
        for gi, g in enumerate(params):
            g = dict(g)
            plist = g.pop("params")
            if isinstance(plist, torch.Tensor):
                plist = [plist]
            refs = []
            for ri, item in enumerate(plist):
                given = None
                if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
                    given, item = item
                e = self._by_param.get(id(item))
                if e is not None:
                    refs.append((given or e.view.name, e.view))
                    continue
                if given:
                    nm = given
                elif id(item) in names:  # on the module but not managed
                    nm = names[id(item)]
                elif id(item) in self._orig_names:
                    nm = "%s (the original parameter, replaced by a shardd view)" % (
                        self._orig_names[id(item)])
                else:
                    nm = "param group %d ref %d (%s of shape %s, not from the wrapped module)" % (
                        gi, ri, type(item).__name__, tuple(getattr(item, "shape", ())))
                refs.append((nm, 0))
            g["params"] = refs
            groups.append(g)
        return groups

    def register_optimizer(self, kind, params=None, name=None, **hyper):
        """Registers an optimizer over torch-style params (default: all managed
        parameters). Every rank must make the identical call (same name).
        Raises shardd.Error (E_NOT_OWNED...) with the daemon's message naming
        each parameter that is not a shardd view."""
        return self.client.register_optimizer(kind, self.param_groups(params), name=name, **hyper)
