/* validate.c — optimizer registration checks (see validate.h). */
#include "validate.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "strbuf.h"

void shardd__hp_overlay(shardd__hp *hp, const shardd__optspec_hp *h) {
  if (h == NULL)
    return;
#define OVERLAY(f)                                                           \
  if (h->has_##f)                                                            \
    hp->f = h->f;
  SHARDD__OPTSPEC_HP_FIELDS(OVERLAY)
#undef OVERLAY
}

void shardd__hp_resolve(shardd_optim_kind kind, const shardd__optspec_hp *top,
                        const shardd__optspec_hp *group, shardd__hp *out) {
  shardd__hp_defaults(kind, out);
  shardd__hp_overlay(out, top);
  shardd__hp_overlay(out, group);
}

/* What the checks collect: the first code and one line per problem, as
 * many as fit in MAX_LISTED_BYTES, then a count of the rest. Unbounded, a
 * request naming one id 3 million times (about 5 bytes a ref on the wire,
 * so under the 16 MiB frame limit) had the daemon build a reply of a
 * gigabyte, one line per duplicate with a 255-byte label, and any reply
 * over SHARDD_MAX_FRAME is one no client can receive. 12 MiB still lists
 * every ref of the 100k-ref refusal (tests/unit/test_validate.c:
 * scale_10k_buffers_100k_views). */
#define MAX_LISTED_BYTES ((size_t)12 << 20)

typedef struct {
  char *text; /* the listed lines, NUL-terminated; NULL until one is */
  size_t len, cap;
  int failed; /* an allocation failed: no text is handed out */
  shardd_err first;
  size_t count;
  size_t unlisted;
} problems;

/* Room in p->text for extra more bytes and the NUL; 0 once that failed. */
static int problems_room(problems *p, size_t extra) {
  if (p->failed)
    return 0;
  if (p->len + extra + 1 <= p->cap)
    return 1;
  size_t cap = p->cap ? p->cap : 4096;
  while (cap < p->len + extra + 1)
    cap *= 2;
  char *t = realloc(p->text, cap);
  if (t == NULL) {
    p->failed = 1;
    return 0;
  }
  p->text = t;
  p->cap = cap;
  return 1;
}

static void problems_append(problems *p, const char *s, size_t n) {
  if (!problems_room(p, n))
    return;
  memcpy(p->text + p->len, s, n);
  p->len += n;
  p->text[p->len] = '\0';
}

static void problem(problems *p, shardd_err code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void problem(problems *p, shardd_err code, const char *fmt, ...) {
  /* Sized to fit: a fixed 512-byte line cut the end (the job's name) off
   * lines naming a long trainer name or job (tests/unit/test_validate.c:
   * long_names_are_not_cut_from_the_message). */
  if (p->count == 0)
    p->first = code;
  if (p->unlisted > 0) { /* the budget is spent: count, do not format */
    p->count++;
    p->unlisted++;
    return;
  }
  /* Formatted once, straight into the text where it fits (it nearly always
   * does): sizing the line, formatting it and then appending it with
   * shardd__sb_printf were four passes of printf per line, most of the
   * cost of a refusal of 100k refs (issue 20 item 10). */
  size_t sep = p->count > 0;
  if (!problems_room(p, sep + 256)) {
    p->count++;
    return;
  }
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(p->text + p->len + sep, p->cap - p->len - sep, fmt, ap);
  va_end(ap);
  if (n < 0) {
    static const char oops[] = "(out of memory describing a problem)";
    p->text[p->len] = '\0';
    if (sep)
      problems_append(p, "\n", 1);
    problems_append(p, oops, sizeof oops - 1);
    p->count++;
    return;
  }
  if (p->count > 0 && p->len + (size_t)n > MAX_LISTED_BYTES) {
    p->text[p->len] = '\0';
    p->count++;
    p->unlisted++;
    return;
  }
  /* the first line is always listed, cut to the byte budget (a label is
   * the client's own text, as long as a frame) */
  size_t keep = (size_t)n > MAX_LISTED_BYTES ? MAX_LISTED_BYTES : (size_t)n;
  if (p->len + sep + (size_t)n + 1 > p->cap) { /* it did not fit: again */
    if (!problems_room(p, sep + keep)) {
      p->count++;
      return;
    }
    va_start(ap, fmt);
    vsnprintf(p->text + p->len + sep, keep + 1, fmt, ap);
    va_end(ap);
  }
  if (sep)
    p->text[p->len] = '\n';
  p->len += sep + keep;
  p->text[p->len] = '\0';
  p->count++;
}

/* One resolved ref, with where it was named, for the cross-ref checks. */
typedef struct {
  size_t group, index;
  const char *label; /* the trainer's name, else the object's */
  shardd__plan_ref ref;
} located;

static const char *obj_kind_word(const shardd__obj *o) {
  return o->kind == SHARDD__OBJ_VIEW ? "view" : "buffer";
}

static int cmp_located(const void *a, const void *b) {
  const located *x = a, *y = b;
  if (x->ref.buf->hdr.id != y->ref.buf->hdr.id)
    return x->ref.buf->hdr.id < y->ref.buf->hdr.id ? -1 : 1;
  if (x->ref.offset != y->ref.offset)
    return x->ref.offset < y->ref.offset ? -1 : 1;
  /* Whole buffers sort before views at the same offset, so the message
   * names the view as the second reference. */
  if (x->ref.obj->kind != y->ref.obj->kind)
    return x->ref.obj->kind == SHARDD__OBJ_BUFFER ? -1 : 1;
  if (x->group != y->group)
    return x->group < y->group ? -1 : 1;
  return x->index < y->index ? -1 : x->index > y->index;
}

/* Refs l[0..n) (sorted by offset) into buf, which other optimizers hold
 * whole or in part: one problem per ref that meets held elements. */
static void check_held(problems *p, shardd__buffer *buf, const located *l,
                      size_t n) {
  if (buf->owner) {
    /* held whole: a whole ref was refused as owned already, so these are
     * views */
    for (size_t i = 0; i < n; i++)
      problem(p, SHARDD_E_OVERLAP,
              "param group %zu, ref %zu (\"%s\"): %s %" PRIu64
              " lies in buffer %" PRIu64 ", which optimizer %" PRIu64
              " (\"%s\") holds whole",
              l[i].group, l[i].index, l[i].label, obj_kind_word(l[i].ref.obj),
              l[i].ref.obj->id, buf->hdr.id, buf->owner->hdr.id,
              buf->owner->hdr.name);
    return;
  }
  /* The buffer's index of held views answers each ref in O(log n):
   * listing (and sorting) every view of the buffer per registration made
   * registering one optimizer per view quadratic (issue 20: 70k
   * optimizers, 969 s). */
  for (size_t i = 0; i < n; i++) {
    uint64_t start = l[i].ref.offset, end = start + l[i].ref.numel;
    const shardd__view *w = shardd__buffer_held_from(buf, start);
    if (w == NULL || w->offset >= end)
      continue;
    if (l[i].ref.obj->kind == SHARDD__OBJ_BUFFER)
      problem(p, SHARDD_E_OVERLAP,
              "param group %zu, ref %zu (\"%s\"): buffer %" PRIu64
              " cannot be registered whole: its view %" PRIu64 " [%" PRIu64
              ", %" PRIu64 ") belongs to optimizer %" PRIu64 " (\"%s\")",
              l[i].group, l[i].index, l[i].label, buf->hdr.id, w->hdr.id,
              w->offset, w->offset + w->numel, w->owner->hdr.id,
              w->owner->hdr.name);
    else
      problem(p, SHARDD_E_OVERLAP,
              "param group %zu, ref %zu (\"%s\"): view %" PRIu64 " [%" PRIu64
              ", %" PRIu64 ") overlaps view %" PRIu64 " [%" PRIu64 ", %" PRIu64
              ") of optimizer %" PRIu64 " (\"%s\")",
              l[i].group, l[i].index, l[i].label, l[i].ref.obj->id, start, end,
              w->hdr.id, w->offset, w->offset + w->numel, w->owner->hdr.id,
              w->owner->hdr.name);
  }
}

/* A whole buffer holding frozen views: one problem naming them (the first
 * few). Returns 0 only when out of memory. */
static int frozen_buffer_problem(problems *p, size_t g, size_t i,
                                 const char *label, shardd__buffer *buf) {
  shardd__view **vs;
  size_t nv;
  if (shardd__buffer_views(buf, &vs, &nv) != SHARDD_OK) {
    problem(p, SHARDD_E_NO_MEMORY, "out of memory validating refs");
    return 0;
  }
  shardd__sb sb;
  shardd__sb_init(&sb);
  size_t shown = 0;
  for (size_t k = 0; k < nv; k++) {
    if (vs[k]->requires_grad)
      continue;
    if (shown < 4)
      shardd__sb_printf(&sb, "%sview %" PRIu64 " (\"%s\") [%" PRIu64
                        ", %" PRIu64 ")",
                        shown ? ", " : "", vs[k]->hdr.id, vs[k]->hdr.name,
                        vs[k]->offset, vs[k]->offset + vs[k]->numel);
    shown++;
  }
  if (shown > 4)
    shardd__sb_printf(&sb, " and %zu more", shown - 4);
  char *list = shardd__sb_take(&sb);
  problem(p, SHARDD_E_INVAL,
          "param group %zu, ref %zu (\"%s\"): buffer %" PRIu64
          " (\"%s\") holds frozen %s (requires_grad=false): %s; register "
          "its trainable views instead of the whole buffer",
          g, i, label, buf->hdr.id, buf->hdr.name,
          shown == 1 ? "view" : "views", list ? list : "?");
  free(list);
  free(vs);
  return 1;
}

static const char *kind_word(shardd_optim_kind k) {
  switch (k) {
  case SHARDD_OPTIM_SGD:
    return "sgd";
  case SHARDD_OPTIM_ADAM:
    return "adam";
  case SHARDD_OPTIM_ADAMW:
    return "adamw";
  }
  return "?";
}

/* The message prefix naming ref i of param group g by its label. */
#define AT "param group %zu, ref %zu (\"%s\"): "

/* Checks ref i of param group g (the request's ref) on its own and against
 * the refs before it (seen, by id); an acceptable one is written to slot
 * and put in seen: 1. 0: refused (a problem recorded), -1: out of memory,
 * validation ends. */
static int check_ref(problems *p, const shardd__registry *reg,
                     const shardd__job *job, shardd_optim_kind kind,
                     shardd__map *seen, size_t g, size_t i,
                     const shardd__optspec_ref *ref, located *slot) {
  uint64_t id = ref->id;
  const shardd__obj *o = shardd__registry_get(reg, id);
  if (o && !shardd__registry_visible(job, o))
    o = NULL; /* another uid's: as if never issued */
  const char *label = ref->name && ref->name[0] ? ref->name : o ? o->name : "";
  uint64_t gen = ref->has_generation ? ref->generation : 0;
  char stale[512];
  if (id != 0 &&
      shardd__registry_stale(reg, job, id, gen, stale, sizeof stale)) {
    problem(p, SHARDD_E_STALE, AT "%s", g, i, label, stale);
    return 0;
  }
  if (o == NULL) {
    if (id == 0)
      problem(p, SHARDD_E_NOT_OWNED,
              AT "not a shardd buffer or view (a tensor the daemon does "
                 "not own)",
              g, i, label);
    else if (shardd__registry_known_freed(reg, job, id))
      problem(p, SHARDD_E_NOT_FOUND,
              AT "id %" PRIu64 " no longer exists (unregistered)", g, i, label,
              id);
    else
      problem(p, SHARDD_E_NOT_FOUND, AT "no buffer or view has id %" PRIu64, g,
              i, label, id);
    return 0;
  }
  if (o->kind == SHARDD__OBJ_OPTIM) {
    problem(p, SHARDD_E_INVAL,
            AT "id %" PRIu64 " is an optimizer, not a buffer or view", g, i,
            label, id);
    return 0;
  }
  if (o->job != job) {
    problem(p, SHARDD_E_NOT_OWNED,
            AT "%s %" PRIu64 " is not owned by job \"%s\"", g, i, label,
            obj_kind_word(o), id, job->name);
    return 0;
  }
  located *prev = shardd__map_get_id(seen, id);
  if (prev) {
    problem(p, SHARDD_E_DUPLICATE,
            AT "%s %" PRIu64 " already appears at param group %zu, ref %zu", g,
            i, label, obj_kind_word(o), id, prev->group, prev->index);
    return 0;
  }
  located *l = slot;
  l->group = g;
  l->index = i;
  l->label = label;
  l->ref.obj = (shardd__obj *)o;
  l->ref.group = (uint32_t)g;
  const shardd__optim *owner;
  if (o->kind == SHARDD__OBJ_VIEW) {
    const shardd__view *v = (const shardd__view *)o;
    l->ref.buf = v->buf;
    l->ref.offset = v->offset;
    l->ref.numel = v->numel;
    owner = v->owner;
  } else {
    const shardd__buffer *b = (const shardd__buffer *)o;
    l->ref.buf = (shardd__buffer *)b;
    l->ref.offset = 0;
    l->ref.numel = b->numel;
    owner = b->owner;
  }
  if (owner) {
    problem(p, SHARDD_E_DUPLICATE,
            AT "%s %" PRIu64 " already belongs to optimizer %" PRIu64
               " (\"%s\")",
            g, i, label, obj_kind_word(o), id, owner->hdr.id, owner->hdr.name);
    return 0;
  }
  /* A frozen view is accepted, as torch accepts a parameter with
   * requires_grad=False: its steps skip it while it stays frozen. A
   * whole buffer holding frozen views is one parameter part frozen,
   * which torch has no meaning for. */
  if (o->kind == SHARDD__OBJ_BUFFER && l->ref.buf->nfrozen > 0) {
    if (!frozen_buffer_problem(p, g, i, label, l->ref.buf))
      return -1;
    return 0;
  }
  if (!shardd__optim_supports(kind, l->ref.buf->dtype)) {
    problem(p, SHARDD_E_DTYPE, AT "dtype %s is not supported by %s", g, i,
            label, shardd_dtype_name(l->ref.buf->dtype), kind_word(kind));
    return 0;
  }
  if (shardd__map_put_id(seen, id, l) != SHARDD_OK) {
    problem(p, SHARDD_E_NO_MEMORY, "out of memory validating refs");
    return -1;
  }
  return 1;
}

/* Overlap: sorted by (buffer, offset), a ref overlaps an earlier one when
 * it starts before the furthest end seen so far in its buffer. */
static void check_overlaps(problems *p, located *locs, size_t nlocs) {
  qsort(locs, nlocs, sizeof *locs, cmp_located);
  size_t reach = 0; /* index of the ref reaching furthest in this buffer */
  for (size_t i = 1; i < nlocs; i++) {
    const located *a = &locs[reach], *b = &locs[i];
    if (a->ref.buf != b->ref.buf) {
      reach = i;
      continue;
    }
    if (b->ref.offset < a->ref.offset + a->ref.numel) {
      if (a->ref.obj->kind == SHARDD__OBJ_BUFFER)
        problem(p, SHARDD_E_OVERLAP,
                "param group %zu, ref %zu (\"%s\"): buffer %" PRIu64
                " is registered whole at param group %zu, ref %zu and also "
                "through %s %" PRIu64,
                b->group, b->index, b->label, a->ref.buf->hdr.id, a->group,
                a->index, obj_kind_word(b->ref.obj), b->ref.obj->id);
      else
        problem(p, SHARDD_E_OVERLAP,
                "param group %zu, ref %zu (\"%s\"): view %" PRIu64
                " [%" PRIu64 ", %" PRIu64 ") overlaps view %" PRIu64
                " [%" PRIu64 ", %" PRIu64 ") at param group %zu, ref %zu",
                b->group, b->index, b->label, b->ref.obj->id, b->ref.offset,
                b->ref.offset + b->ref.numel, a->ref.obj->id, a->ref.offset,
                a->ref.offset + a->ref.numel, a->group, a->index);
    }
    if (b->ref.offset + b->ref.numel > a->ref.offset + a->ref.numel)
      reach = i;
  }
}

/* Memory other optimizers hold. The per-ref owner check only sees the
 * object named; without this a buffer held whole by one optimizer could be
 * registered again through its views, or a held view's elements through
 * the whole buffer or an overlapping view, and two optimizers would update
 * the same elements (tests/unit/test_validate.c:
 * memory_held_by_another_optimizer). Only buffers with nowned > 0 are
 * looked at, so the common case costs nothing. locs: sorted by buffer. */
static void check_held_all(problems *p, const located *locs, size_t nlocs) {
  for (size_t i = 0; i < nlocs;) {
    size_t end = i;
    while (end < nlocs && locs[end].ref.buf == locs[i].ref.buf)
      end++;
    if (locs[i].ref.buf->nowned > 0)
      check_held(p, locs[i].ref.buf, locs + i, end - i);
    i = end;
  }
}

shardd_err shardd__validate_optimizer(const shardd__registry *reg,
                                      const shardd__job *job,
                                      const shardd__optspec *req,
                                      shardd__optim_plan *plan, char **msg) {
  problems p;
  memset(&p, 0, sizeof p);
  memset(plan, 0, sizeof *plan);
  *msg = NULL;
  located *locs = NULL;
  size_t nlocs = 0, total = 0;
  shardd__map seen;
  shardd__map_init(&seen);

  shardd_optim_kind kind = (shardd_optim_kind)req->kind;
  if (kind != SHARDD_OPTIM_SGD && kind != SHARDD_OPTIM_ADAM &&
      kind != SHARDD_OPTIM_ADAMW) {
    problem(&p, SHARDD_E_INVAL, "optimizer kind %d is not sgd, adam or adamw",
            (int)req->kind);
    goto done;
  }
  if (req->ngroups == 0) {
    problem(&p, SHARDD_E_INVAL, "the optimizer has no param groups");
    goto done;
  }

  plan->groups = calloc(req->ngroups, sizeof *plan->groups);
  for (size_t g = 0; g < req->ngroups; g++)
    total += req->groups[g].nrefs;
  locs = calloc(total ? total : 1, sizeof *locs);
  if (plan->groups == NULL || locs == NULL) {
    problem(&p, SHARDD_E_NO_MEMORY, "out of memory validating the optimizer");
    goto done;
  }
  plan->ngroups = req->ngroups;

  for (size_t g = 0; g < req->ngroups; g++) {
    const shardd__optspec_group *grp = &req->groups[g];
    shardd__hp *hp = &plan->groups[g];
    shardd__hp_resolve(kind, req->has_hyper ? &req->hyper : NULL,
                       grp->has_overrides ? &grp->overrides : NULL, hp);
    char why[256];
    if (shardd__hp_check(hp, why, sizeof why) != SHARDD_OK)
      problem(&p, SHARDD_E_RANGE, "param group %zu: %s", g, why);
    if (grp->nrefs == 0)
      problem(&p, SHARDD_E_INVAL, "param group %zu is empty", g);

    for (size_t i = 0; i < grp->nrefs; i++) {
      int r = check_ref(&p, reg, job, kind, &seen, g, i, &grp->refs[i],
                        &locs[nlocs]);
      if (r < 0)
        goto done;
      nlocs += (size_t)r;
    }
  }

  check_overlaps(&p, locs, nlocs);
  check_held_all(&p, locs, nlocs);

done:
  shardd__map_free(&seen);
  if (p.count > 0) {
    if (p.unlisted > 0) {
      char more[128];
      int m = snprintf(more, sizeof more,
                       "\n... and %zu more problem%s not listed (%zu in all)",
                       p.unlisted, p.unlisted == 1 ? "" : "s", p.count);
      problems_append(&p, more, (size_t)m);
    }
    free(locs);
    shardd__optim_plan_free(plan);
    if (p.failed || p.text == NULL) {
      free(p.text);
      p.text = NULL;
    }
    *msg = p.text;
    return p.first;
  }
  free(p.text);
  plan->kind = kind;
  plan->name = strdup(req->name && req->name[0] ? req->name : "default");
  plan->refs = malloc((nlocs ? nlocs : 1) * sizeof *plan->refs);
  if (plan->name == NULL || plan->refs == NULL) {
    free(locs);
    shardd__optim_plan_free(plan);
    *msg = strdup("out of memory validating the optimizer");
    return SHARDD_E_NO_MEMORY;
  }
  for (size_t i = 0; i < nlocs; i++)
    plan->refs[i] = locs[i].ref;
  plan->nrefs = nlocs;
  free(locs);
  return SHARDD_OK;
}
