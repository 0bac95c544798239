/* buckets.c — buckets: several gathers or scatters in one request, checked
 * all or nothing, each entry submitted as its own collective, one reply
 * when all have ended (see dispatch_int.h). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch_int.h"
#include "hash.h"
#include "log.h"
#include "varint.h"

/* Entries per request: --max-pending's default, so a bucket fits a rank
 * that waits in nothing else (libshardd cuts a longer list). */
#define BUCKET_MAX 64

/* A bucket of one connection whose entries have not all ended: each entry
 * is its own collective, submitted with the request's seq; the engine's
 * done hook tells them apart by target, and the one reply goes when the
 * last has ended. */
typedef struct shardd__bucket_wait {
  struct shardd__bucket_wait *next;
  shardd__conn *c;
  uint64_t seq;
  const char *what; /* "bucket gathers" | "bucket scatters" */
  size_t n, left;
  int submitting; /* the handler's loop runs: the reply waits for it */
  batch_errs fails;
  uint64_t ids[]; /* [n] the entries' buffers */
} bucket_wait;

static void bucket_free(bucket_wait *w) {
  shardd__batch_errs_free(&w->fails);
  free(w);
}

static void bucket_unlink(shardd__dispatch *d, bucket_wait *w) {
  for (bucket_wait **pp = &d->buckets; *pp; pp = &(*pp)->next)
    if (*pp == w) {
      *pp = w->next;
      return;
    }
}

bucket_wait *shardd__bucket_find(shardd__dispatch *d, const shardd__conn *c,
                                 uint64_t seq) {
  for (bucket_wait *w = d->buckets; w; w = w->next)
    if (w->c == c && w->seq == seq)
      return w;
  return NULL;
}

/* The one reply, once every entry has ended; w is freed. */
static void bucket_answer(shardd__dispatch *d, bucket_wait *w) {
  bucket_unlink(d, w);
  if (w->fails.total == 0) {
    Shardwire__Response resp = ok_resp(w->seq, SHARDWIRE__RESPONSE__BODY_BUCKET);
    Shardwire__BucketReply kb = SHARDWIRE__BUCKET_REPLY__INIT;
    resp.bucket = &kb;
    shardd__send_resp(d, w->c, &resp, -1);
    bucket_free(w);
    return;
  }
  char head[160];
  snprintf(head, sizeof head, "%zu of the %zu entries of a %s failed "
           "(the others ran): ", w->fails.total, w->n, w->what);
  shardd__batch_send(d, w->c, w->seq, &w->fails, head, "bucket");
  bucket_free(w);
}

/* One entry of w ended (the engine's done hook). */
void shardd__bucket_note(shardd__dispatch *d, bucket_wait *w, shardd_err code,
                         const char *msg, const shardd__coll_result *res) {
  if (code != SHARDD_OK) {
    size_t i = 0;
    while (res && i < w->n && w->ids[i] != res->target)
      i++;
    shardd__batch_err_add(&w->fails, i < w->n ? i : 0, code,
                          msg ? msg : shardd_strerror(code));
  }
  if (w->left > 0)
    w->left--;
  if (w->left == 0 && !w->submitting)
    bucket_answer(d, w);
}

/* A 64-bit name of the bucket's list (kind, count, buffers in order), for
 * the engine to see that every rank sent the same bucket: FNV-1a over the
 * words' little-endian bytes. It used to start from a basis one digit
 * short of FNV-1a's; it now starts from FNV-1a's own, which changes its
 * values, and may: they are compared only between the ranks of one daemon
 * (shardd__coll_args.bucket), never sent to another node nor written. */
static uint64_t bucket_hash(shardd__coll_kind kind, const uint64_t *ids,
                            size_t n) {
  uint64_t h = SHARDD__FNV1A_BASIS;
  uint64_t words[2] = {(uint64_t)kind, (uint64_t)n};
  for (size_t k = 0; k < 2 + n; k++)
    h = shardd__fnv1a_u64(h, k < 2 ? words[k] : ids[k - 2]);
  return h ? h : 1; /* 0 means "not in a bucket" */
}

typedef struct {
  uint64_t id;
  uint32_t at;
} id_at;

static int cmp_id_at(const void *a, const void *b) {
  const id_at *x = a, *y = b;
  if (x->id != y->id)
    return x->id < y->id ? -1 : 1;
  return x->at < y->at ? -1 : x->at > y->at;
}

/* first[i] = the first entry naming ids[i]'s buffer (i itself when none
 * before it does): sorted by (id, entry), not every pair compared (n <=
 * BUCKET_MAX). */
static void first_entries(const uint64_t *ids, size_t n, uint32_t *first) {
  /* a model's units registered together have ascending ids, and a bucket
   * lists them in that order: no buffer twice, nothing to sort */
  size_t up = 1;
  while (up < n && ids[up - 1] < ids[up])
    up++;
  if (up >= n) {
    for (size_t i = 0; i < n; i++)
      first[i] = (uint32_t)i;
    return;
  }
  id_at v[BUCKET_MAX];
  for (size_t i = 0; i < n; i++)
    v[i] = (id_at){ids[i], (uint32_t)i};
  qsort(v, n, sizeof *v, cmp_id_at);
  for (size_t k = 0; k < n; k++)
    first[v[k].at] = k > 0 && v[k - 1].id == v[k].id ? first[v[k - 1].at]
                                                      : v[k].at;
}

void shardd__on_bucket(shardd__dispatch *d, shardd__conn *c, uint64_t seq,
                       const Shardwire__Request *req) {
  const Shardwire__Bucket *bk = req->bucket;
  int gather = bk->op_case == SHARDWIRE__BUCKET__OP_GATHER;
  if (!gather && bk->op_case != SHARDWIRE__BUCKET__OP_SCATTER) {
    shardd__reply(d, c, seq, SHARDD_E_INVAL, "Bucket names no operation");
    return;
  }
  size_t n = gather ? bk->gather->n_gathers : bk->scatter->n_scatters;
  uint32_t base = gather ? (bk->gather->has_first_index ? bk->gather->first_index : 0)
                         : (bk->scatter->has_first_index ? bk->scatter->first_index : 0);
  const char *what = gather ? "bucket gathers" : "bucket scatters";
  shardd__job *job = c->m.job;
  char err[ERRLEN];
  if (n == 0) {
    Shardwire__Response resp = ok_resp(seq, SHARDWIRE__RESPONSE__BODY_BUCKET);
    Shardwire__BucketReply kb = SHARDWIRE__BUCKET_REPLY__INIT;
    resp.bucket = &kb;
    shardd__send_resp(d, c, &resp, -1);
    return;
  }
  if (gather && job->transient) {
    /* each gathered buffer would lease its own slot, as large as the
     * job's largest unit, of the 2 a rank may hold: the memory bound */
    snprintf(err, sizeof err, "job \"%s\" has transient areas: each gather "
             "leases a slot as large as its largest unit, %" PRIu32 " per "
             "rank, so gathers are not bucketed (gather each unit alone; "
             "scatter buckets are fine)", job->name,
             d->reg.leases_per_rank[SHARDD__AREA_GATHER]);
    shardd__reply(d, c, seq, SHARDD_E_STATE, err);
    return;
  }
  if (shardd__coll_member_waits(d->coll, &c->m, seq)) {
    shardd__seq_refuse(d, c, seq, "collective still in flight");
    return;
  }
  uint32_t room = d->opts.max_pending > c->m.pending
                      ? d->opts.max_pending - c->m.pending : 0;
  if (n > BUCKET_MAX || n > room) {
    snprintf(err, sizeof err, "a bucket of %zu entries: at most %d per "
             "request, and this rank may queue %" PRIu32 " more collectives "
             "(--max-pending %" PRIu32 ")", n, BUCKET_MAX, room,
             d->opts.max_pending);
    shardd__reply(d, c, seq, SHARDD_E_LIMIT, err);
    return;
  }
  /* one allocation for the wait and its list; its error list serves the
   * checks first (a refused bucket is answered from it and freed) */
  bucket_wait *w = calloc(1, sizeof *w + n * sizeof *w->ids);
  if (w == NULL) {
    shardd__reply(d, c, seq, SHARDD_E_NO_MEMORY, "out of memory");
    return;
  }
  shardd__batch_errs_init(&w->fails, n, base);
  for (size_t i = 0; i < n; i++)
    w->ids[i] = gather ? bk->gather->gathers[i]->buffer
                       : bk->scatter->scatters[i]->buffer;
  uint32_t first[BUCKET_MAX];
  first_entries(w->ids, n, first);
  /* every entry checked before any is submitted: all or nothing; what
   * each resolves to is handed to its submit (not looked up again) */
  shardd__obj *objs[BUCKET_MAX];
  for (size_t i = 0; i < n; i++) {
    uint64_t id = w->ids[i];
    uint64_t gen = gather ? bk->gather->gathers[i]->generation
                          : bk->scatter->scatters[i]->generation;
    shardd_err rc = shardd__registry_resolve_gen(&d->reg, job, id, gen,
                                                 SHARDD__OBJ_BUFFER, &objs[i],
                                                 err, sizeof err);
    if (rc == SHARDD_OK && !gather &&
        bk->scatter->scatters[i]->op != SHARDWIRE__REDUCE_OP__SUM &&
        bk->scatter->scatters[i]->op != SHARDWIRE__REDUCE_OP__MEAN) {
      snprintf(err, sizeof err, "scatter op must be sum or mean");
      rc = SHARDD_E_INVAL;
    }
    if (rc == SHARDD_OK && first[i] != i) {
      snprintf(err, sizeof err, "buffer %" PRIu64 " is named twice (entry %"
               PRIu64 " too)", id, (uint64_t)first[i] + base);
      rc = SHARDD_E_DUPLICATE;
    }
    if (rc != SHARDD_OK)
      shardd__batch_err_add(&w->fails, i, rc, err);
  }
  if (w->fails.total > 0) {
    shardd__batch_refuse(d, c, seq, n, &w->fails, what);
    bucket_free(w);
    return;
  }
  w->c = c;
  w->seq = seq;
  w->what = what;
  w->n = w->left = n;
  w->submitting = 1;
  w->next = d->buckets;
  d->buckets = w;
  shardd__coll_kind kind = gather ? SHARDD__COLL_GATHER : SHARDD__COLL_SCATTER;
  uint64_t sig = bucket_hash(kind, w->ids, n);
  size_t i = 0;
  shardd__coll_batch_begin(d->coll);
  /* an entry refused at once (a bucket the ranks before disagree with)
   * ends the submitting on one node, so nothing waits for the rest; over
   * several nodes every entry goes, its exchange telling the other nodes
   * (coll.c's bucket_fail) */
  int all = job->nodes > 1;
  for (; i < n && (all || w->fails.total == 0); i++) {
    shardd__coll_args ca = {.kind = kind, .target = w->ids[i], .bucket = sig,
                            .bucket_n = (uint32_t)n, .bucket_index = (uint32_t)i,
                            .resolved = objs[i]};
    if (gather) {
      ca.generation = bk->gather->gathers[i]->generation;
    } else {
      const Shardwire__Scatter *sc = bk->scatter->scatters[i];
      ca.generation = sc->generation;
      ca.op = (shardd_reduce_op)sc->op;
      ca.accumulate = sc->has_accumulate && sc->accumulate;
      ca.no_grad = sc->no_grad;
      ca.nno_grad = sc->n_no_grad;
      ca.no_grad_all = sc->has_no_grad_all && sc->no_grad_all;
    }
    shardd__coll_submit(d->coll, &c->m, seq, &ca);
  }
  shardd__coll_batch_end(d->coll);
  w->left -= n - i; /* the entries not submitted */
  w->submitting = 0;
  if (w->left == 0)
    bucket_answer(d, w);
}

/* c is going away: its buckets' waiting entries were answered (the engine
 * lost c's member); running ones forget c, nobody is left to answer. */
void shardd__buckets_closed(shardd__dispatch *d, const shardd__conn *c) {
  for (bucket_wait **pp = &d->buckets; *pp;) {
    bucket_wait *w = *pp;
    if (w->c == c) {
      *pp = w->next;
      bucket_free(w);
    } else
      pp = &w->next;
  }
}

void shardd__buckets_free(shardd__dispatch *d) {
  while (d->buckets) { /* every connection closed first: none is left */
    bucket_wait *w = d->buckets;
    d->buckets = w->next;
    bucket_free(w);
  }
}

/* ---- a bucket request decoded by hand ---------------------------------
 *
 * protobuf-c decoded a bucket's request at about 850 instructions an entry
 * (a descriptor walk, an init and a field lookup per entry): 54,000 for a
 * request of 64, and the four ranks' requests of one bucket arrive
 * together, so all four decodings were on the bucket's critical path,
 * about a quarter of the daemon's instructions per bucket outside the
 * sums. The shape every client sends (seq, then a Bucket whose
 * GatherMany or ScatterMany lists entries of the plain fields) is read
 * here into the same structures protobuf-c would fill; anything else (an
 * unknown or repeated field, a no-gradient list, a varint past 63 bits,
 * more than BUCKET_MAX entries, a required field missing) returns NULL
 * and protobuf-c decodes it, so what a request means never depends on the
 * path. */

/* one Scatter or Gather entry's fields (all varints, each at most once) */
static int decode_entry(shardd__wire *w, int gather, void *out) {
  uint32_t field, wt, seen = 0;
  uint64_t v;
  shardd__wire sub;
  Shardwire__Scatter *sc = out;
  Shardwire__Gather *g = out;
  while (w->p < w->end) {
    if (!shardd__wire_field(w, &field, &wt, &v, &sub) || wt != 0 || field > 4 ||
        (seen & (1u << field)))
      return 0;
    seen |= 1u << field;
    if (field == 1) {
      if (gather)
        g->buffer = v;
      else
        sc->buffer = v;
    } else if (gather && field == 2) {
      g->has_generation = 1;
      g->generation = v;
    } else if (gather && field == 3) {
      g->has_want_grad = 1;
      g->want_grad = v != 0;
    } else if (!gather && field == 2) {
      if (v > SHARDWIRE__REDUCE_OP__MIN)
        return 0;
      sc->has_op = 1;
      sc->op = (Shardwire__ReduceOp)v;
    } else if (!gather && field == 3) {
      sc->has_generation = 1;
      sc->generation = v;
    } else if (!gather && field == 4) {
      sc->has_accumulate = 1;
      sc->accumulate = v != 0;
    } else {
      return 0;
    }
  }
  return (seen & 2u) != 0; /* buffer is required */
}

/* a GatherMany or ScatterMany: its entries and first_index */
static int decode_many(shardd__wire *w, int gather, shardd__decode_alloc alloc,
                       void *ctx, void *many) {
  size_t esz = gather ? sizeof(Shardwire__Gather) : sizeof(Shardwire__Scatter);
  void **list = alloc(ctx, BUCKET_MAX * sizeof *list);
  uint8_t *mem = alloc(ctx, BUCKET_MAX * esz);
  if (list == NULL || mem == NULL)
    return 0;
  size_t n = 0;
  int has_first = 0;
  uint64_t first = 0, v;
  uint32_t field, wt;
  shardd__wire sub;
  while (w->p < w->end) {
    if (!shardd__wire_field(w, &field, &wt, &v, &sub))
      return 0;
    if (field == 1 && wt == 2 && n < BUCKET_MAX) {
      void *e = mem + n * esz;
      if (gather) {
        Shardwire__Gather init = SHARDWIRE__GATHER__INIT;
        memcpy(e, &init, sizeof init);
      } else {
        Shardwire__Scatter init = SHARDWIRE__SCATTER__INIT;
        memcpy(e, &init, sizeof init);
      }
      if (!decode_entry(&sub, gather, e))
        return 0;
      list[n++] = e;
    } else if (field == 2 && wt == 0 && !has_first && v <= UINT32_MAX) {
      has_first = 1;
      first = v;
    } else {
      return 0;
    }
  }
  if (gather) {
    Shardwire__GatherMany *gm = many;
    gm->n_gathers = n;
    gm->gathers = (Shardwire__Gather **)list;
    gm->has_first_index = has_first;
    gm->first_index = (uint32_t)first;
  } else {
    Shardwire__ScatterMany *sm = many;
    sm->n_scatters = n;
    sm->scatters = (Shardwire__Scatter **)list;
    sm->has_first_index = has_first;
    sm->first_index = (uint32_t)first;
  }
  return 1;
}

/* the Bucket: exactly one of its two lists */
static int decode_bucket(shardd__wire *w, shardd__decode_alloc alloc, void *ctx,
                         Shardwire__Bucket *bk) {
  uint64_t v;
  uint32_t field, wt;
  shardd__wire sub;
  if (!shardd__wire_field(w, &field, &wt, &v, &sub) || wt != 2 || w->p != w->end ||
      (field != 1 && field != 2))
    return 0;
  if (field == 1) {
    Shardwire__GatherMany init = SHARDWIRE__GATHER_MANY__INIT;
    Shardwire__GatherMany *gm = alloc(ctx, sizeof *gm);
    if (gm == NULL)
      return 0;
    *gm = init;
    bk->op_case = SHARDWIRE__BUCKET__OP_GATHER;
    bk->gather = gm;
    return decode_many(&sub, 1, alloc, ctx, gm);
  }
  Shardwire__ScatterMany init = SHARDWIRE__SCATTER_MANY__INIT;
  Shardwire__ScatterMany *sm = alloc(ctx, sizeof *sm);
  if (sm == NULL)
    return 0;
  *sm = init;
  bk->op_case = SHARDWIRE__BUCKET__OP_SCATTER;
  bk->scatter = sm;
  return decode_many(&sub, 0, alloc, ctx, sm);
}

Shardwire__Request *shardd__bucket_decode(shardd__decode_alloc alloc, void *ctx,
                                          const uint8_t *payload, size_t len) {
  shardd__wire sub = {NULL, NULL};
  uint64_t seq = 0;
  if (!shardd__wire_seq_body(payload, len, 35, &seq, &sub))
    return NULL;
  Shardwire__Request rinit = SHARDWIRE__REQUEST__INIT;
  Shardwire__Bucket binit = SHARDWIRE__BUCKET__INIT;
  Shardwire__Request *req = alloc(ctx, sizeof *req);
  Shardwire__Bucket *bk = alloc(ctx, sizeof *bk);
  if (req == NULL || bk == NULL)
    return NULL;
  *req = rinit;
  *bk = binit;
  if (!decode_bucket(&sub, alloc, ctx, bk))
    return NULL;
  req->seq = seq;
  req->body_case = SHARDWIRE__REQUEST__BODY_BUCKET;
  req->bucket = bk;
  return req;
}
