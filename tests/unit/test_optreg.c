/* test_optreg.c — the optimizer-registration use case (policy/optreg.h) and
 * its wire codec (policy/optcodec.h): registrations are built on the stack
 * as the wire delivers them, converted as the daemon converts them, and
 * registered in a registry over a real host backend. Identity is checked
 * against the bytes protobuf-c packs the client's message to. */
#include <criterion/criterion.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "optcodec.h"
#include "optreg.h"
#include "proto/shardd.pb-c.h"
#include "registry.h"

static shardd__backend *be;
static shardd__registry reg;
static shardd__job *job;
static shardd__buffer *w, *e;
static shardd__view *v0, *v1;
static char err[512];

static void setup(void) {
  cr_assert_eq(shardd__backend_host_create(1, 1ull << 30, &be, err, sizeof err),
               SHARDD_OK, "%s", err);
  shardd__registry_init(&reg, be);
  cr_assert_eq(shardd__job_get(&reg, "llm", 2, 0, &job, err, sizeof err),
               SHARDD_OK);
  int created;
  cr_assert_eq(shardd__buffer_register(&reg, job, "w", SHARDD_DTYPE_FP32, 100,
                                       &w, &created, err, sizeof err),
               SHARDD_OK, "%s", err);
  cr_assert_eq(shardd__buffer_register(&reg, job, "e", SHARDD_DTYPE_BF16, 64,
                                       &e, &created, err, sizeof err),
               SHARDD_OK, "%s", err);
  int64_t s0[1] = {40}, s1[1] = {60};
  cr_assert_eq(shardd__view_register(&reg, job, w->hdr.id, "w.a", 0, 40, s0, 1,
                                     &v0, &created, err, sizeof err),
               SHARDD_OK, "%s", err);
  cr_assert_eq(shardd__view_register(&reg, job, w->hdr.id, "w.b", 40, 60, s1, 1,
                                     &v1, &created, err, sizeof err),
               SHARDD_OK, "%s", err);
}

static void teardown(void) {
  shardd__registry_free(&reg);
  if (be) {
    be->ops->destroy(be);
    be = NULL;
  }
}

TestSuite(optreg, .init = setup, .fini = teardown);

/* A two-group AdamW registration with top-level and group overrides and
 * generations on some refs, as a client sends it. */
typedef struct {
  Shardwire__RegisterOptimizer ro;
  Shardwire__HyperParams hyper, over;
  Shardwire__ParamGroup g[2], *gp[2];
  Shardwire__ParamRef r[3], *rp[3];
} wire;

static void wire_init(wire *m, const char *name) {
  memset(m, 0, sizeof *m);
  shardwire__register_optimizer__init(&m->ro);
  shardwire__hyper_params__init(&m->hyper);
  shardwire__hyper_params__init(&m->over);
  m->ro.name = (char *)name;
  m->ro.kind = SHARDWIRE__OPTIM_KIND__ADAMW;
  m->hyper.has_lr = 1;
  m->hyper.lr = 3e-4;
  m->hyper.has_beta2 = 1;
  m->hyper.beta2 = 0.95;
  m->ro.hyper = &m->hyper;
  m->over.has_weight_decay = 1;
  m->over.weight_decay = 0.0;
  m->over.has_amsgrad = 1;
  m->over.amsgrad = 1;
  uint64_t ids[3] = {v0->hdr.id, v1->hdr.id, e->hdr.id};
  const char *names[3] = {"layer.0", "", NULL};
  for (int i = 0; i < 3; i++) {
    shardwire__param_ref__init(&m->r[i]);
    m->r[i].id = ids[i];
    m->r[i].name = (char *)names[i];
    m->rp[i] = &m->r[i];
  }
  m->r[0].has_generation = 1;
  m->r[0].generation = v0->hdr.generation;
  m->r[2].has_generation = 1;
  m->r[2].generation = 0; /* set to 0: not checked, but present */
  for (int g = 0; g < 2; g++) {
    shardwire__param_group__init(&m->g[g]);
    m->gp[g] = &m->g[g];
  }
  m->g[0].refs = m->rp;
  m->g[0].n_refs = 2;
  m->g[1].refs = m->rp + 2;
  m->g[1].n_refs = 1;
  m->g[1].overrides = &m->over;
  m->ro.groups = m->gp;
  m->ro.n_groups = 2;
}

static uint8_t *pack(const Shardwire__RegisterOptimizer *ro, size_t *len) {
  *len = shardwire__register_optimizer__get_packed_size(ro);
  uint8_t *b = malloc(*len ? *len : 1);
  cr_assert_not_null(b);
  shardwire__register_optimizer__pack(ro, b);
  return b;
}

static shardd_err reg_wire(const Shardwire__RegisterOptimizer *ro,
                           shardd__optreg_result *res) {
  shardd__optspec spec;
  cr_assert_eq(shardd__optspec_from_wire(ro, &spec), SHARDD_OK);
  shardd_err rc = shardd__optreg_register(&reg, job, &spec,
                                          SHARDD__OPTREG_ATTACH, res, err,
                                          sizeof err);
  shardd__optspec_free(&spec);
  return rc;
}

Test(optreg, encode_of_a_client_message_is_its_packed_bytes) {
  wire m;
  wire_init(&m, "opt");
  size_t plen;
  uint8_t *packed = pack(&m.ro, &plen);
  shardd__optspec spec;
  cr_assert_eq(shardd__optspec_from_wire(&m.ro, &spec), SHARDD_OK);
  uint8_t *enc;
  size_t elen;
  cr_assert_eq(shardd__optspec_encode(&spec, &enc, &elen), SHARDD_OK);
  cr_assert_eq(elen, plen);
  cr_assert(memcmp(enc, packed, plen) == 0);
  shardd__optspec_free(&spec);
  free(enc);
  free(packed);
}

Test(optreg, decode_then_encode_round_trips) {
  wire m;
  wire_init(&m, "opt");
  size_t plen;
  uint8_t *packed = pack(&m.ro, &plen);
  shardd__optspec spec;
  cr_assert_eq(shardd__optspec_decode(packed, plen, &spec), SHARDD_OK);
  /* the fields, read back independently of the encoder */
  cr_assert_str_eq(spec.name, "opt");
  cr_assert_eq(spec.kind, SHARDD_OPTIM_ADAMW);
  cr_assert(spec.has_hyper && spec.hyper.has_lr && spec.hyper.lr == 3e-4);
  cr_assert(spec.hyper.has_beta2 && spec.hyper.beta2 == 0.95);
  cr_assert(!spec.hyper.has_beta1 && !spec.hyper.has_amsgrad);
  cr_assert_eq(spec.ngroups, 2);
  cr_assert(!spec.groups[0].has_overrides);
  cr_assert_eq(spec.groups[0].nrefs, 2);
  cr_assert_eq(spec.groups[0].refs[0].id, v0->hdr.id);
  cr_assert_str_eq(spec.groups[0].refs[0].name, "layer.0");
  cr_assert(spec.groups[0].refs[0].has_generation);
  cr_assert_eq(spec.groups[0].refs[0].generation, v0->hdr.generation);
  cr_assert_str_eq(spec.groups[0].refs[1].name, "", "set but empty");
  cr_assert(!spec.groups[0].refs[1].has_generation);
  cr_assert(spec.groups[1].has_overrides);
  cr_assert(spec.groups[1].overrides.has_weight_decay &&
            spec.groups[1].overrides.weight_decay == 0.0);
  cr_assert(spec.groups[1].overrides.has_amsgrad &&
            spec.groups[1].overrides.amsgrad == 1);
  cr_assert_eq(spec.groups[1].nrefs, 1);
  cr_assert_null(spec.groups[1].refs[0].name, "unset stays unset");
  cr_assert(spec.groups[1].refs[0].has_generation);
  cr_assert_eq(spec.groups[1].refs[0].generation, 0);
  uint8_t *enc;
  size_t elen;
  cr_assert_eq(shardd__optspec_encode(&spec, &enc, &elen), SHARDD_OK);
  cr_assert_eq(elen, plen);
  cr_assert(memcmp(enc, packed, plen) == 0, "encode(decode(x)) == x");
  shardd__optspec_free(&spec);
  free(enc);
  free(packed);
}

Test(optreg, presence_is_part_of_identity) {
  wire a, b;
  wire_init(&a, "opt");
  wire_init(&b, "opt");
  Shardwire__HyperParams empty = SHARDWIRE__HYPER_PARAMS__INIT;
  b.g[0].overrides = &empty; /* present but empty: another registration */
  shardd__optspec sa, sb;
  cr_assert_eq(shardd__optspec_from_wire(&a.ro, &sa), SHARDD_OK);
  cr_assert_eq(shardd__optspec_from_wire(&b.ro, &sb), SHARDD_OK);
  uint8_t *ea, *eb;
  size_t la, lb;
  cr_assert_eq(shardd__optspec_encode(&sa, &ea, &la), SHARDD_OK);
  cr_assert_eq(shardd__optspec_encode(&sb, &eb, &lb), SHARDD_OK);
  cr_assert(la != lb || memcmp(ea, eb, la) != 0);
  shardd__optspec_free(&sa);
  shardd__optspec_free(&sb);
  free(ea);
  free(eb);
}

Test(optreg, garbage_does_not_decode) {
  const uint8_t junk[] = {0xff, 0xff, 0xff};
  shardd__optspec spec;
  cr_assert_eq(shardd__optspec_decode(junk, sizeof junk, &spec), SHARDD_E_INVAL);
  cr_assert_eq(spec.ngroups, 0);
  shardd__optspec_free(&spec);
}

Test(optreg, an_identical_registration_attaches) {
  wire m;
  wire_init(&m, "opt");
  shardd__optreg_result r1, r2;
  cr_assert_eq(reg_wire(&m.ro, &r1), SHARDD_OK, "%s", err);
  cr_assert_eq(r1.created, 1);
  cr_assert_not_null(r1.optim);
  size_t plen;
  uint8_t *packed = pack(&m.ro, &plen);
  cr_assert_eq(r1.optim->spec_len, plen, "identity: the client's bytes");
  cr_assert(memcmp(r1.optim->spec, packed, plen) == 0);
  free(packed);

  wire again; /* another rank: the same registration, built anew */
  wire_init(&again, "opt");
  cr_assert_eq(reg_wire(&again.ro, &r2), SHARDD_OK, "%s", err);
  cr_assert_eq(r2.created, 0);
  cr_assert_eq(r2.optim, r1.optim);
  cr_assert_eq(r2.optim->hdr.id, r1.optim->hdr.id);
  cr_assert_null(r2.list);
  cr_assert_eq(shardd__map_count(&job->optims), 1);
}

Test(optreg, another_registration_under_the_name_is_a_mismatch) {
  wire m;
  wire_init(&m, "opt");
  shardd__optreg_result r1, r2;
  cr_assert_eq(reg_wire(&m.ro, &r1), SHARDD_OK, "%s", err);
  m.hyper.lr = 1e-3; /* one hyperparameter differs */
  uint64_t next = reg.next_id;
  cr_assert_eq(reg_wire(&m.ro, &r2), SHARDD_E_MISMATCH);
  cr_assert_eq(r2.refused, 0);
  cr_assert_null(r2.optim);
  char want[512];
  snprintf(want, sizeof want,
           "optimizer \"opt\" (id %" PRIu64 ") exists in job \"llm\" with "
           "another registration; ranks must register identical optimizers, "
           "or use another name",
           r1.optim->hdr.id);
  cr_assert_str_eq(err, want);
  cr_assert_eq(reg.next_id, next, "nothing registered");
  cr_assert_eq(shardd__map_count(&job->optims), 1);
}

Test(optreg, a_refusal_lists_every_problem) {
  wire m;
  wire_init(&m, NULL); /* "default" */
  m.r[1].id = 999999; /* no such object */
  m.r[2].id = v0->hdr.id; /* named twice */
  m.r[2].has_generation = 0;
  shardd__optreg_result r;
  shardd_err rc = reg_wire(&m.ro, &r);
  cr_assert_eq(rc, SHARDD_E_NOT_FOUND, "got %s", shardd_err_name(rc));
  cr_assert_eq(r.refused, 1);
  cr_assert_not_null(r.list);
  char want[512];
  snprintf(want, sizeof want,
           "param group 0, ref 1 (\"\"): no buffer or view has id 999999\n"
           "param group 1, ref 0 (\"w.a\"): view %" PRIu64
           " already appears at param group 0, ref 0",
           v0->hdr.id);
  cr_assert_str_eq(r.list, want);
  cr_assert_null(shardd__optim_find(job, "default"));
  free(r.list);
}
