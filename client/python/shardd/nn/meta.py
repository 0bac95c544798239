"""A module built on the meta device, materialized one module at a time
(param_init_fn): the checksums of the units' initial values, then each
rank's parts of the shards."""
import zlib

import torch
from torch import nn

from ._precision import _DTYPE_OF


def _materialize(module, init_fn, sink):
    """Materializes every parameter and buffer of `module` on the meta device
    on the CPU, one module at a time in registration order (module.modules()):
    the module's own meta tensors become empty CPU tensors, then
    init_fn(module) (default: the module's reset_parameters()) initializes
    them, as building the model on the CPU does when its constructors
    initialize through reset_parameters in that order. Buffers stay
    materialized on the module; each parameter's values go to
    sink(original parameter, values) right after its first owner's init
    and the module gets its (meta) parameter back, so that no more than one
    module's parameters are materialized at a time. A parameter tied after
    construction (``head.weight = emb.weight``) has the values of the
    module it was taken from, the first owner: a later owner's init runs
    on a scratch tensor (it draws from the RNG as on the CPU, where it
    initialized a parameter the tie then dropped). A parameter not on the
    meta device goes to the sink as it is."""
    done = set()  # ids of the parameters already sunk
    for name, m in module.named_modules():
        own = [(k, p) for k, p in m._parameters.items() if p is not None]
        metas = [(k, p) for k, p in own if p.is_meta]
        mbufs = [(k, b) for k, b in m._buffers.items() if b is not None and b.is_meta]
        made = {}
        if metas or mbufs:
            if init_fn is None and not callable(getattr(m, "reset_parameters", None)):
                raise ValueError(
                    "module %r (%s) has parameters or buffers on the meta device and no "
                    "reset_parameters(): pass param_init_fn= to initialize them"
                    % (name or "<root>", type(m).__name__))
            for k, p in metas:
                t = made.get(id(p))
                if t is None:
                    t = made[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype),
                                                   requires_grad=p.requires_grad)
                m._parameters[k] = t
            for k, b in mbufs:
                m._buffers[k] = torch.empty(b.shape, dtype=b.dtype)
            try:
                with torch.no_grad():
                    if init_fn is not None:
                        init_fn(m)
                    else:
                        m.reset_parameters()
            finally:
                for k, p in metas:
                    m._parameters[k] = p
        for k, p in own:
            if id(p) not in done:
                done.add(id(p))
                sink(p, made[id(p)].detach() if p.is_meta else p.detach())
        made = None


class _MetaInit:
    """ShardedModule's meta-device initialization."""

    # -- meta-device init --------------------------------------------------
    def _meta_checksums(self, module, units, init_fn):
        """The crc32 of each unit's flattened initial values (what
        _checksum gives for a CPU-built model), from one materialization:
        a unit's values are checksummed in the unit's order, those that
        come early (a tied weight waits for its last owner) held until
        their turn."""
        where = {}
        for ui, u in enumerate(units):
            for k, (_, p, _) in enumerate(u[2]):
                where[id(p)] = (ui, k)
        crc = [0] * len(units)
        nxt = [0] * len(units)
        held = [{} for _ in units]

        def sink(p, v):
            if id(p) not in where:
                return
            ui, k = where[id(p)]
            held[ui][k] = v
            dt = _DTYPE_OF[units[ui][3]]
            while nxt[ui] in held[ui]:
                t = held[ui].pop(nxt[ui]).reshape(-1).to(dt).contiguous()
                crc[ui] = zlib.crc32(t.view(torch.uint8).numpy(), crc[ui])
                nxt[ui] += 1

        _materialize(module, init_fn, sink)
        return crc

    def _meta_write(self, module, writes, init_fn):
        """Materializes the model again (the buffers stay on the module)
        and writes each parameter's part of this rank's shard as it comes;
        16-bit units' fp32 masters from the exact values."""
        rank = self.client.rank
        where = {}
        exact = []
        for wi, (params, udt, total, buf, sh) in enumerate(writes):
            off = 0
            for _, p, _ in params:
                where[id(p)] = (wi, off)
                off += p.numel()
            sh.zero_()
            n = max(0, min(buf.shard_numel, total - rank * buf.shard_numel))
            exact.append(torch.zeros(n) if udt != "fp32" else None)

        def sink(p, v):
            if id(p) not in where:
                return
            wi, off = where[id(p)]
            _, _, _, buf, sh = writes[wi]
            s0 = rank * buf.shard_numel
            a = max(off, s0)
            b = min(off + v.numel(), s0 + buf.shard_numel)
            if b <= a:
                return
            v = v.reshape(-1)[a - off:b - off]
            sh[a - s0:b - s0].copy_(v.to(sh.dtype).to(sh.device))
            if exact[wi] is not None:
                exact[wi][a - s0:b - s0].copy_(v.float())

        _materialize(module, init_fn, sink)
        for (params, udt, total, buf, sh), ex in zip(writes, exact):
            if ex is not None:
                self.client.seed_master(buf, ex)
