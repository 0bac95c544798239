/* coll_join.c — forming and re-forming a job's fabric: the join (see the
 * top of coll_fabric.c) every new fabric runs first, comparing the nodes'
 * fabric lineage and the summary of their state, so a node restored from
 * another step, or fresh, or of another run of the job, fails it on every
 * node before anything moves. */
#include "coll_int.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "fabric.h"
#include "hash.h"
#include "log.h"

/* What each node says when a fabric (re)forms, allgathered once on it
 * before any exchange: fixed-width fields, no padding. */
typedef struct {
  uint32_t magic, flags;
  uint64_t lineage;  /* the job's (0: never formed, not restored so) */
  uint64_t proposal; /* a new lineage, taken from node 0 when all are 0 */
  uint64_t origin;   /* job->origin, for the message only */
  /* the node's state when the exchange was submitted (coll.fab_state) */
  uint64_t nbufs, bufs_digest, nopts, opts_digest, steps_min, steps_max;
} fab_join_hdr;

#define FAB_JOIN_MAGIC 0x53484a31u /* "SHJ1": bump when it changes */
#define FAB_JOIN_REJOINING 1u
/* the join runs before any exchange of the new fabric on either node, so
 * a tag an exchange may also fold to is no conflict */
#define FAB_JOIN_TAG 0x7fffffffu

_Static_assert(sizeof(fab_join_hdr) == 80, "fab_join_hdr must have no padding");

/* c->fab_state: this node's buffers (name, numel, dtype) and optimizers
 * (name, step count), summed as hashes so that the order of ids (which
 * differs between a survivor and a restored node) does not count. Loop
 * thread; c->fab_join_ok says whether it could be listed. */
void shardd__coll_fab_state_of(coll *c) {
  shardd__buffer **bufs = NULL;
  shardd__optim **opts = NULL;
  size_t nb = 0, no = 0;
  memset(&c->fab_state, 0, sizeof c->fab_state);
  c->fab_join_ok = 0;
  if (shardd__job_buffers(c->job, &bufs, &nb) != SHARDD_OK ||
      shardd__job_optims(c->job, &opts, &no) != SHARDD_OK) {
    free(bufs);
    return;
  }
  c->fab_state.nbufs = nb;
  for (size_t i = 0; i < nb; i++) {
    uint64_t h = shardd__fnv1a(SHARDD__FNV1A_BASIS, bufs[i]->hdr.name,
                                  strlen(bufs[i]->hdr.name) + 1);
    uint64_t nd[2] = {bufs[i]->numel, (uint64_t)bufs[i]->dtype};
    c->fab_state.bufs_digest += shardd__fnv1a(h, nd, sizeof nd);
  }
  c->fab_state.nopts = no;
  c->fab_state.steps_min = no ? UINT64_MAX : 0;
  for (size_t i = 0; i < no; i++) {
    uint64_t h = shardd__fnv1a(SHARDD__FNV1A_BASIS, opts[i]->hdr.name,
                                  strlen(opts[i]->hdr.name) + 1);
    c->fab_state.opts_digest +=
        shardd__fnv1a(h, &opts[i]->steps, sizeof opts[i]->steps);
    if (opts[i]->steps < c->fab_state.steps_min)
      c->fab_state.steps_min = opts[i]->steps;
    if (opts[i]->steps > c->fab_state.steps_max)
      c->fab_state.steps_max = opts[i]->steps;
  }
  free(bufs);
  free(opts);
  c->fab_join_ok = 1;
}

static uint64_t fresh_lineage(void) {
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  uint64_t seed[3] = {(uint64_t)now.tv_sec, (uint64_t)now.tv_nsec,
                      (uint64_t)getpid() << 32 ^ (uint64_t)(uintptr_t)&now};
  uint64_t h = shardd__fnv1a(SHARDD__FNV1A_BASIS, seed, sizeof seed);
  return h ? h : 1;
}

static void steps_words(const fab_join_hdr *h, char *out, size_t len) {
  if (h->nopts == 0)
    snprintf(out, len, "no optimizer");
  else if (h->steps_min == h->steps_max)
    snprintf(out, len, "%" PRIu64 " optimizer%s at step %" PRIu64, h->nopts,
             h->nopts == 1 ? "" : "s", h->steps_min);
  else
    snprintf(out, len, "%" PRIu64 " optimizers at steps %" PRIu64 "..%" PRIu64,
             h->nopts, h->steps_min, h->steps_max);
}

static const char *lineage_words(const fab_join_hdr *h) {
  return h->flags & FAB_JOIN_REJOINING ? "restored from its exit checkpoint"
         : h->lineage                  ? "live state"
                                       : "a fresh job";
}

/* 0 when every node's join header fits this node's; else -1, msg naming
 * the first node that differs and what. */
static int join_check(const char *job, const fab_join_hdr *h, uint32_t nodes,
                      uint32_t me, char *msg, size_t len) {
  const fab_join_hdr *m = &h[me];
  int check_state = 0;
  for (uint32_t n = 0; n < nodes; n++)
    check_state |= h[n].lineage != 0 || (h[n].flags & FAB_JOIN_REJOINING);
  for (uint32_t n = 0; n < nodes; n++) {
    const fab_join_hdr *o = &h[n];
    if (n == me)
      continue;
    if (o->magic != m->magic) {
      snprintf(msg, len, "node %" PRIu32 " speaks another version of the fabric "
               "protocol (join %#" PRIx32 ", this node %#" PRIx32 "): run the "
               "same shardd on every node", n, o->magic, m->magic);
      return -1;
    }
    if (o->lineage != m->lineage) {
      snprintf(msg, len, "node %" PRIu32 " holds job \"%.32s\" as %s (fabric "
               "lineage %016" PRIx64 "), this node as %s (lineage %016" PRIx64
               "): their states do not belong together. Restart a stopped "
               "node's daemon with --restore of its --checkpoint-on-exit part, "
               "or release the job on every node and restore a collective "
               "checkpoint", n, job, lineage_words(o), o->lineage,
               lineage_words(m), m->lineage);
      return -1;
    }
    if (!check_state)
      continue;
    if (o->nbufs != m->nbufs || o->bufs_digest != m->bufs_digest) {
      snprintf(msg, len, "node %" PRIu32 " holds %" PRIu64 " buffers of job \"%.32s\""
               ", this node %" PRIu64 " (or their names, sizes or dtypes "
               "differ): the nodes' states do not fit together, refusing to "
               "train on them", n, o->nbufs, job, m->nbufs);
      return -1;
    }
    if (o->nopts != m->nopts || o->opts_digest != m->opts_digest) {
      char ow[64], mw[64];
      steps_words(o, ow, sizeof ow);
      steps_words(m, mw, sizeof mw);
      snprintf(msg, len, "node %" PRIu32 " holds job \"%.32s\" with %.60s (%s), "
               "this node with %.60s: a node restored a checkpoint of another "
               "step, or applied a step the other did not; refusing to train "
               "on mixed state (release the job on every node and restore a "
               "collective checkpoint)", n, job, ow, lineage_words(o), mw);
      return -1;
    }
  }
  return 0;
}

/* The first allgather on a new fabric: the nodes' lineages must agree
 * (all 0 the first time: node 0's proposal becomes the job's), and where
 * any node has a lineage or rejoins, their states too. A refusal is
 * SHARDD_E_MISMATCH on every node alike (each sees every header). */
shardd_err shardd__coll_fab_join(coll_fab *jf, const coll *c, shardd__fabric *f,
                                 uint64_t lineage, int rejoining, uint64_t *out,
                                 char *err, size_t errlen) {
  (void)jf;
  const shardd__job *job = c->job;
  fab_join_hdr *h = calloc(job->nodes, sizeof *h);
  if (h == NULL) {
    snprintf(err, errlen, "out of memory for the fabric's join");
    return SHARDD_E_NO_MEMORY;
  }
  fab_join_hdr *m = &h[job->node_rank];
  m->magic = FAB_JOIN_MAGIC;
  m->flags = rejoining ? FAB_JOIN_REJOINING : 0;
  m->lineage = lineage;
  m->proposal = fresh_lineage();
  m->origin = job->origin;
  m->nbufs = c->fab_state.nbufs;
  m->bufs_digest = c->fab_state.bufs_digest;
  m->nopts = c->fab_state.nopts;
  m->opts_digest = c->fab_state.opts_digest;
  m->steps_min = c->fab_state.steps_min;
  m->steps_max = c->fab_state.steps_max;
  char why[384];
  shardd_err rc = shardd__fabric_allgather(f, h, sizeof *h, FAB_JOIN_TAG, why,
                                           sizeof why);
  if (rc != SHARDD_OK)
    snprintf(err, errlen, "fabric: join: %.300s", why);
  else if (join_check(job->name, h, job->nodes, job->node_rank, err, errlen))
    rc = SHARDD_E_MISMATCH;
  else
    *out = m->lineage ? m->lineage : h[0].proposal;
  free(h);
  return rc;
}

/* The exchange of c on fabric f: header, check, data. A failure that
 * leaves f unusable is t->rc with *lost set. */

