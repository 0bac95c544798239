/* optcodec.c — RegisterOptimizer <-> shardd__optspec (see optcodec.h). */
#include "optcodec.h"

#include <stdlib.h>
#include <string.h>

void shardd__optspec_hp_from_wire(const Shardwire__HyperParams *h,
                                  shardd__optspec_hp *o) {
  memset(o, 0, sizeof *o);
#define COPY(f)                                                              \
  o->has_##f = h->has_##f != 0;                                              \
  o->f = h->f;
  SHARDD__OPTSPEC_HP_FIELDS(COPY)
#undef COPY
}

static void hp_to_wire(const shardd__optspec_hp *o, Shardwire__HyperParams *h) {
  shardwire__hyper_params__init(h);
#define COPY(f)                                                              \
  h->has_##f = o->has_##f != 0;                                              \
  h->f = o->f;
  SHARDD__OPTSPEC_HP_FIELDS(COPY)
#undef COPY
}

/* strdup that keeps NULL (unset) apart from "" (set); 0 when out of
 * memory. */
static int dup_opt(const char *s, char **out) {
  *out = s ? strdup(s) : NULL;
  return s == NULL || *out != NULL;
}

void shardd__optspec_free(shardd__optspec *spec) {
  if (spec == NULL)
    return;
  for (size_t g = 0; g < spec->ngroups; g++) {
    shardd__optspec_group *grp = &spec->groups[g];
    for (size_t i = 0; i < grp->nrefs; i++)
      free(grp->refs[i].name);
    free(grp->refs);
  }
  free(spec->groups);
  free(spec->name);
  memset(spec, 0, sizeof *spec);
}

shardd_err shardd__optspec_from_wire(const Shardwire__RegisterOptimizer *ro,
                                     shardd__optspec *out) {
  memset(out, 0, sizeof *out);
  out->kind = (int)ro->kind;
  if (ro->hyper) {
    out->has_hyper = 1;
    shardd__optspec_hp_from_wire(ro->hyper, &out->hyper);
  }
  if (!dup_opt(ro->name, &out->name))
    goto nomem;
  if (ro->n_groups > 0) {
    out->groups = calloc(ro->n_groups, sizeof *out->groups);
    if (out->groups == NULL)
      goto nomem;
  }
  for (size_t g = 0; g < ro->n_groups; g++) {
    const Shardwire__ParamGroup *wg = ro->groups[g];
    shardd__optspec_group *grp = &out->groups[g];
    out->ngroups = g + 1; /* what free must walk, should this group fail */
    if (wg->overrides) {
      grp->has_overrides = 1;
      shardd__optspec_hp_from_wire(wg->overrides, &grp->overrides);
    }
    if (wg->n_refs == 0)
      continue;
    grp->refs = calloc(wg->n_refs, sizeof *grp->refs);
    if (grp->refs == NULL)
      goto nomem;
    for (size_t i = 0; i < wg->n_refs; i++) {
      const Shardwire__ParamRef *wr = wg->refs[i];
      shardd__optspec_ref *r = &grp->refs[i];
      grp->nrefs = i + 1;
      r->id = wr->id;
      r->has_generation = wr->has_generation != 0;
      r->generation = wr->generation;
      if (!dup_opt(wr->name, &r->name))
        goto nomem;
    }
  }
  return SHARDD_OK;
nomem:
  shardd__optspec_free(out);
  return SHARDD_E_NO_MEMORY;
}

shardd_err shardd__optspec_decode(const uint8_t *bytes, size_t len,
                                  shardd__optspec *out) {
  memset(out, 0, sizeof *out);
  Shardwire__RegisterOptimizer *ro =
      shardwire__register_optimizer__unpack(NULL, len, bytes);
  if (ro == NULL)
    return SHARDD_E_INVAL;
  shardd_err rc = shardd__optspec_from_wire(ro, out);
  shardwire__register_optimizer__free_unpacked(ro, NULL);
  return rc;
}

shardd_err shardd__optspec_encode(const shardd__optspec *spec, uint8_t **bytes,
                                  size_t *len) {
  *bytes = NULL;
  *len = 0;
  /* The message borrows the spec's strings; only its arrays are made
   * here: one block of groups and one of every ref. */
  size_t total = 0;
  for (size_t g = 0; g < spec->ngroups; g++)
    total += spec->groups[g].nrefs;
  Shardwire__RegisterOptimizer ro = SHARDWIRE__REGISTER_OPTIMIZER__INIT;
  Shardwire__HyperParams hyper;
  Shardwire__ParamGroup *groups = calloc(spec->ngroups ? spec->ngroups : 1,
                                      sizeof *groups);
  Shardwire__ParamGroup **gptrs = calloc(spec->ngroups ? spec->ngroups : 1,
                                      sizeof *gptrs);
  Shardwire__HyperParams *over = calloc(spec->ngroups ? spec->ngroups : 1,
                                     sizeof *over);
  Shardwire__ParamRef *refs = calloc(total ? total : 1, sizeof *refs);
  Shardwire__ParamRef **rptrs = calloc(total ? total : 1, sizeof *rptrs);
  shardd_err rc = SHARDD_E_NO_MEMORY;
  if (groups == NULL || gptrs == NULL || over == NULL || refs == NULL ||
      rptrs == NULL)
    goto done;
  ro.name = spec->name;
  ro.kind = (Shardwire__OptimKind)spec->kind;
  if (spec->has_hyper) {
    hp_to_wire(&spec->hyper, &hyper);
    ro.hyper = &hyper;
  }
  ro.groups = gptrs;
  ro.n_groups = spec->ngroups;
  size_t k = 0;
  for (size_t g = 0; g < spec->ngroups; g++) {
    const shardd__optspec_group *grp = &spec->groups[g];
    shardwire__param_group__init(&groups[g]);
    gptrs[g] = &groups[g];
    if (grp->has_overrides) {
      hp_to_wire(&grp->overrides, &over[g]);
      groups[g].overrides = &over[g];
    }
    groups[g].refs = rptrs + k;
    groups[g].n_refs = grp->nrefs;
    for (size_t i = 0; i < grp->nrefs; i++, k++) {
      const shardd__optspec_ref *r = &grp->refs[i];
      shardwire__param_ref__init(&refs[k]);
      refs[k].id = r->id;
      refs[k].name = r->name;
      refs[k].has_generation = r->has_generation != 0;
      refs[k].generation = r->generation;
      rptrs[k] = &refs[k];
    }
  }
  size_t n = shardwire__register_optimizer__get_packed_size(&ro);
  uint8_t *out = malloc(n ? n : 1);
  if (out == NULL)
    goto done;
  shardwire__register_optimizer__pack(&ro, out);
  *bytes = out;
  *len = n;
  rc = SHARDD_OK;
done:
  free(groups);
  free(gptrs);
  free(over);
  free(refs);
  free(rptrs);
  return rc;
}
