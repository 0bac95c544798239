/* coll_exchange.c — a collective's exchange across the nodes of its job
 * (see the top of coll_fabric.c): the header every node allgathers first
 * and its checks, then the data: a gather's allgather, a scatter's
 * reduce-scatter and its views' gradient flags, a step's sums of squares,
 * the scalar all-reduce. */
#include "coll_int.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fabric.h"
#include "hash.h"
#include "log.h"

typedef struct {
  uint32_t magic, kind; /* kind | FAB_KIND_REFUSED: refused on that node */
  uint64_t name;  /* fab_key */
  uint64_t seq;   /* exchanges of this kind and target the node made before */
  uint64_t numel; /* the buffer's (0 for step) */
  uint64_t bytes; /* payload per node */
  uint32_t dtype, op;
  /* scatter: the buffer's views, whose gradient flags follow the data
   * (UINT64_MAX: this node could not list them) */
  uint64_t nviews;
  /* step: every parameter a node could disagree on (-1: no lr given) */
  double lr, max_norm;
  uint64_t hp_digest; /* the groups' hyperparameters and the norm-only flag */
  /* the job-level checkpoint the node's job was restored from (its seal,
   * job->origin; 0 none): nodes that restored different checkpoints, or
   * one restored and one fresh, fail their first exchange instead of
   * training on mixed state */
  uint64_t origin;
  double value; /* step: the node's sum of squares; not compared */
} fab_hdr;

#define FAB_MAGIC 0x53484635u /* "SHF5": bump when the header changes */
#define FAB_KIND_REFUSED 0x10000u

_Static_assert(sizeof(fab_hdr) == 96, "fab_hdr must have no padding");

/* FNV-1a over a step's resolved hyperparameters, field by field (a struct's
 * padding bytes are not its value). */
static uint64_t step_digest(const coll *c) {
  uint64_t h = SHARDD__FNV1A_BASIS;
  int flag = c->args.norm_only;
  h = shardd__fnv1a(h, &flag, sizeof flag);
  for (size_t g = 0; c->hp && g < c->opt->ngroups; g++) {
    const shardd__hp *p = &c->hp[g];
    int ints[4] = {(int)p->kind, p->nesterov, p->maximize, p->amsgrad};
    double d[7] = {p->lr, p->momentum, p->dampening, p->weight_decay,
                   p->beta1, p->beta2, p->eps};
    h = shardd__fnv1a(h, ints, sizeof ints);
    h = shardd__fnv1a(h, d, sizeof d);
  }
  return h;
}

static const char *dtype_word(uint32_t dt) {
  const char *n = shardd_dtype_name((shardd_dtype)dt);
  return n ? n : "?";
}

/* a scatter header's op: the reduce op, FAB_OP_ADDING set when it adds to
 * the reduced gradient held */
#define FAB_OP_ADDING 0x100u

static const char *op_word(uint32_t op) {
  switch (op) {
  case SHARDD_REDUCE_MEAN: return "mean";
  case SHARDD_REDUCE_SUM: return "sum";
  case SHARDD_REDUCE_MEAN | FAB_OP_ADDING: return "mean, accumulating";
  case SHARDD_REDUCE_SUM | FAB_OP_ADDING: return "sum, accumulating";
  case SHARDD_REDUCE_MAX: return "max";
  case SHARDD_REDUCE_MIN: return "min";
  default: return "the daemon's own (a collective checkpoint)";
  }
}

/* 0 when every node's header matches this node's; else -1 and msg says
 * what the first node that differs has instead. */
static int fab_check(const coll *c, const fab_hdr *h, uint32_t nodes,
                     uint32_t me, char *msg, size_t len) {
  const fab_hdr *m = &h[me];
  const char *kw = shardd__coll_kind_word(c->args.kind), *tw = shardd__coll_target_word(c->args.kind);
  for (uint32_t n = 0; n < nodes; n++) {
    const fab_hdr *o = &h[n];
    if (n == me || memcmp(o, m, offsetof(fab_hdr, value)) == 0)
      continue;
    if (o->magic == m->magic && (o->kind & FAB_KIND_REFUSED))
      snprintf(msg, len,
               "node %" PRIu32 " refused %s of %s \"%s\" locally (its ranks "
               "were told why: an argument invalid there, or its ranks "
               "disagreeing); nothing moved, and the fabric stays up",
               n, shardd__coll_kind_word((shardd__coll_kind)(o->kind & ~FAB_KIND_REFUSED)),
               tw, c->name);
    else if (o->magic != m->magic)
      snprintf(msg, len,
               "node %" PRIu32 " speaks another version of the fabric protocol "
               "(header %#" PRIx32 ", this node %#" PRIx32 "): run the same "
               "shardd on every node",
               n, o->magic, m->magic);
    else if (o->origin != m->origin)
      snprintf(msg, len,
               "node %" PRIu32 " restored job \"%s\" from %s%08" PRIx64 "%s, "
               "this node from %s%08" PRIx64 "%s: every node must restore its "
               "part of the same job checkpoint (release the job and restore "
               "it again on every node)",
               n, c->job->name, o->origin ? "the checkpoint sealed " : "",
               o->origin & 0xffffffffu, o->origin ? "" : " (no checkpoint: a fresh job)",
               m->origin ? "the checkpoint sealed " : "", m->origin & 0xffffffffu,
               m->origin ? "" : " (no checkpoint: a fresh job)");
    else if (o->kind != m->kind || o->name != m->name)
      snprintf(msg, len,
               "node %" PRIu32 " exchanged %s of another target where this node "
               "exchanged %s of %s \"%s\": two names share fabric tag %" PRIu32
               " and the nodes ran them in different orders",
               n, shardd__coll_kind_word((shardd__coll_kind)o->kind), kw, tw, c->name, c->tag);
    else if (o->seq != m->seq)
      snprintf(msg, len,
               "node %" PRIu32 " is at its %s #%" PRIu64 " of %s \"%s\", this "
               "node at #%" PRIu64 ": the nodes' exchanges of it are out of "
               "step (one node skipped one), so they would pair the wrong "
               "calls; restart the job",
               n, kw, o->seq + 1, tw, c->name, m->seq + 1);
    else if (o->numel != m->numel || o->dtype != m->dtype || o->bytes != m->bytes)
      snprintf(msg, len,
               "node %" PRIu32 " has %s \"%s\" as %" PRIu64 " %s elements (%" PRIu64
               " bytes per node), this node as %" PRIu64 " %s (%" PRIu64 "): "
               "register it alike on every node",
               n, tw, c->name, o->numel, dtype_word(o->dtype), o->bytes, m->numel,
               dtype_word(m->dtype), m->bytes);
    else if (o->op != m->op)
      snprintf(msg, len,
               "node %" PRIu32 " reduces %s \"%s\" by %s, this node by %s: every "
               "rank must pass the same reduction",
               n, tw, c->name, op_word(o->op), op_word(m->op));
    else if (o->lr != m->lr)
      snprintf(msg, len,
               "node %" PRIu32 " steps %s \"%s\" with lr %g, this node with %g "
               "(-1: the registered rates): every rank must pass the same",
               n, tw, c->name, o->lr, m->lr);
    else if (o->max_norm != m->max_norm)
      snprintf(msg, len,
               "node %" PRIu32 " steps %s \"%s\" with max_norm %g, this node "
               "with %g: every rank must clip alike",
               n, tw, c->name, o->max_norm, m->max_norm);
    else if (o->hp_digest != m->hp_digest)
      snprintf(msg, len,
               "node %" PRIu32 " steps %s \"%s\" with other per-group "
               "hyperparameters (lr, betas, eps, weight_decay, momentum... of "
               "some param group, as a scheduler set them) or a norm-only step "
               "where this node steps: every rank must pass the same",
               n, tw, c->name);
    else if (o->nviews == UINT64_MAX || m->nviews == UINT64_MAX)
      snprintf(msg, len, "node %" PRIu32 " could not list the views of %s \"%s\" "
               "(out of memory)", o->nviews == UINT64_MAX ? n : me, tw, c->name);
    else
      snprintf(msg, len,
               "node %" PRIu32 " has %" PRIu64 " views of %s \"%s\", this node %"
               PRIu64 ": register them alike on every node",
               n, o->nviews, tw, c->name, m->nviews);
    return -1;
  }
  return 0;
}

/* An all_reduce across nodes: each node's local reduction (c->reduced;
 * a mean is already divided by the whole world) is allgathered and
 * combined in node order, so every node gets the same bits. A barrier
 * (no values) is its header alone. */
static shardd_err fab_all_reduce(coll *c, shardd__fabric *f, char *msg,
                                 size_t len) {
  size_t n = (size_t)c->args.target;
  if (n == 0)
    return SHARDD_OK;
  const shardd__job *job = c->job;
  double *all = calloc((size_t)job->nodes * n, sizeof *all);
  if (all == NULL) {
    snprintf(msg, len, "out of memory for the all_reduce exchange");
    return SHARDD_E_NO_MEMORY;
  }
  memcpy(all + (size_t)job->node_rank * n, c->reduced, n * sizeof *all);
  shardd_err rc = shardd__fabric_allgather(f, all, n * sizeof *all, c->tag, msg, len);
  if (rc == SHARDD_OK)
    for (size_t i = 0; i < n; i++) {
      double acc = all[i];
      for (uint32_t k = 1; k < job->nodes; k++)
        acc = shardd__coll_combine((int)c->args.op, acc, all[(size_t)k * n + i]);
      c->reduced[i] = acc;
    }
  free(all);
  return rc;
}

void shardd__coll_fab_exchange(coll *c, task *t, shardd__fabric *f, int *lost) {
  shardd__job *job = c->job;
  shardd__buffer *b = c->buf;
  uint64_t part = b ? (uint64_t)job->local_ranks * b->shard_numel : 0;
  fab_hdr *h = calloc(job->nodes, sizeof *h);
  if (h == NULL) {
    /* the peers wait for this node's header in vain: the fabric is lost */
    t->rc = SHARDD_E_NO_MEMORY;
    snprintf(c->fab_msg, sizeof c->fab_msg, "out of memory for the exchange header");
    *lost = 1;
    return;
  }
  fab_hdr *m = &h[job->node_rank];
  m->magic = FAB_MAGIC;
  m->kind = (uint32_t)c->args.kind | (c->refused != SHARDD_OK ? FAB_KIND_REFUSED : 0);
  m->name = c->name_key;
  m->seq = c->fab_seq;
  m->origin = job->origin;
  if (c->args.kind == SHARDD__COLL_ALL_REDUCE) {
    /* the values' count and the op are compared; the checkpoint barrier's
     * op is its own, so it never pairs with a plain barrier */
    m->numel = c->args.target;
    m->bytes = c->args.target * sizeof(double);
    m->op = (uint32_t)c->args.op;
  } else if (b) {
    m->numel = b->numel;
    m->dtype = (uint32_t)b->dtype;
    m->bytes = part * (c->args.kind == SHARDD__COLL_SCATTER
                           ? 4 /* the fp32 staging area */
                           : shardd_dtype_size(b->dtype));
    m->op = c->args.kind == SHARDD__COLL_SCATTER
                ? (uint32_t)c->args.op | (c->adding ? FAB_OP_ADDING : 0)
                : 0;
    if (c->args.kind == SHARDD__COLL_SCATTER)
      m->nviews = c->fab_mask ? c->nmask : UINT64_MAX;
  } else {
    m->value = c->sumsq_all;
    m->lr = c->args.has_lr ? c->args.lr : -1.0;
    m->max_norm = c->args.max_norm;
    m->hp_digest = step_digest(c);
  }
  t->rc = shardd__fabric_allgather(f, h, sizeof *h, c->tag, c->fab_msg,
                                   sizeof c->fab_msg);
  if (t->rc == SHARDD_OK && c->refused != SHARDD_OK) {
    /* the header told the others; the ranks here have their answer */
    t->rc = c->refused;
    snprintf(c->fab_msg, sizeof c->fab_msg, "%s", c->refused_msg);
    free(h);
    return;
  }
  if (t->rc == SHARDD_OK &&
      fab_check(c, h, job->nodes, job->node_rank, c->fab_msg, sizeof c->fab_msg)) {
    /* every node saw the same headers and fails this one alike; the
     * connections are fine, so the fabric stays up */
    t->rc = SHARDD_E_MISMATCH;
    free(h);
    return;
  }
  if (t->rc == SHARDD_OK) {
    switch (c->args.kind) {
    case SHARDD__COLL_GATHER: {
      shardd__region *r = b->blocks[job->local_first];
      t->rc = shardd__fabric_allgather(f, (char *)r->ptr + b->gather_off,
                                       part * shardd_dtype_size(b->dtype), c->tag,
                                       c->fab_msg, sizeof c->fab_msg);
      break;
    }
    case SHARDD__COLL_SCATTER:
      if (c->fab_mask == NULL) { /* every node could not list its views */
        t->rc = SHARDD_E_NO_MEMORY;
        snprintf(c->fab_msg, sizeof c->fab_msg, "out of memory listing the views "
                 "of buffer \"%s\"", c->name);
        break;
      }
      t->rc = shardd__fabric_reduce_scatter_f32(f, (float *)b->stage->ptr, part,
                                                c->tag, c->fab_msg,
                                                sizeof c->fab_msg);
      /* which views had a gradient on which node: a view no rank of any
       * node had one for is skipped by the step (coll.c) */
      if (t->rc == SHARDD_OK)
        t->rc = shardd__fabric_allgather(f, c->fab_mask, c->nmask + 1, c->tag,
                                         c->fab_msg, sizeof c->fab_msg);
      break;
    case SHARDD__COLL_STEP: {
      /* in node order on every node, so all get the same bits */
      double sum = 0;
      for (uint32_t n = 0; n < job->nodes; n++)
        sum += h[n].value;
      c->sumsq_all = sum;
      break;
    }
    case SHARDD__COLL_ALL_REDUCE:
      t->rc = fab_all_reduce(c, f, c->fab_msg, sizeof c->fab_msg);
      break;
    }
  }
  free(h);
  if (t->rc != SHARDD_OK)
    *lost = 1;
}

/* The exchange of c, on a fabric thread. */

