"""A hook of the script's on a parameter's AccumulateGrad node
(``p.expand_as(p).grad_fn.next_functions[0][0].register_hook``, torch
1.13's stand-in for a post-accumulate-grad hook, used for an optimizer
step in backward; or ``register_prehook``).

Made before wrapping, it is on the node of the parameter the wrapper
replaces (emptied, never in a graph again): it would never run, with no
error. On a transient client, made after wrapping, it is on the node of
the wrapper's parameter, which accumulates a unit's gradient in the
unit's gradient area, reduce-scattered once every gradient of the unit is
in: it would see this rank's unreduced gradient (whole) or the reduced
part (the parameter released), depending on the order of the unit's
parameters, not torch's; and one made while the parameter is its 1-D
part of the shard (before the first forward) made the node with the
part's shape, which failed the backward on a shape. Both are refused,
naming the parameter, where they are first seen: at wrapping, at the
unit's first gather, or when autograd accumulates the parameter's
gradient (the backward then refused as any, its areas released).

torch 1.13 shows no node's hooks, but a hook registered on a node
returns a handle holding a weak reference to the node's one dict of
Python hooks: a throwaway hook registered and removed reads its size."""
import torch

import shardd


def _noop(*args):
    return None


def script_hooks(node):
    """How many Python hooks (post and pre) node holds."""
    n = 0
    for reg in (node.register_hook, node.register_prehook):
        h = reg(_noop)
        d = h.hooks_dict_ref()
        n += len(d) - 1 if d is not None else 0
        h.remove()
    return n


def accumulate_node(p):
    """p's AccumulateGrad node (the one autograd keeps for it while it is
    alive; made now otherwise)."""
    with torch.enable_grad():
        return p.expand_as(p).grad_fn.next_functions[0][0]


def refusal(name, when):
    return shardd.Error(
        22, "parameter %r has a hook on its AccumulateGrad node "
        "(p.expand_as(p).grad_fn.next_functions[0][0].register_hook / register_prehook) "
        "%s; register it on the parameter instead (p.register_hook, before wrapping or "
        "after: it sees this rank's gradient whole, as under DDP), or act on the "
        "gradients after backward (an optimizer's step sees each rank's part of the "
        "reduced gradient)" % (name, when), "E_STATE")


BEFORE = ("made before wrapping: that node is the original parameter's, which the "
          "wrapper replaces, so the hook would never run")
AFTER = ("made after wrapping: the wrapper accumulates a unit's gradients in its "
         "gradient area and reduce-scatters it once all are in, so the hook would see "
         "this rank's unreduced gradient or the reduced part, depending on the order "
         "of the unit's parameters, not torch's")


def check_originals(params):
    """At wrapping, before anything changed: [(qualified name, p)] of the
    originals, refused where a hook is on p's AccumulateGrad node."""
    for qn, p in params:
        if p.requires_grad and p.grad_fn is None and script_hooks(accumulate_node(p)):
            raise refusal(qn, BEFORE)
