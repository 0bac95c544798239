/* test_checkpoint.c — checkpoint write/restore: a round trip keeps every
 * byte of shards and optimizer state, corrupt or partial checkpoints are
 * refused naming the bad file with nothing registered, and a job restored
 * into a new daemon continues training bit-identically to one that never
 * stopped. */
#include <criterion/criterion.h>
#include <inttypes.h>
#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "checkpoint.h"
#include "harness.h"
#include "manifest.h"
#include "optcodec.h"
#include "proto/shardd.pb-c.h"
#include "registry.h"
#include "validate.h"

static char dir[64];
static shardd__backend *be;
static shardd__registry reg;

static void rm_tree(const char *path) {
  DIR *d = opendir(path);
  if (d == NULL)
    return;
  for (struct dirent *e; (e = readdir(d)) != NULL;) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
      continue;
    char p[512];
    snprintf(p, sizeof p, "%s/%s", path, e->d_name);
    if (e->d_type == DT_DIR)
      rm_tree(p);
    else
      unlink(p);
  }
  closedir(d);
  rmdir(path);
}

static void setup(void) {
  snprintf(dir, sizeof dir, "/tmp/shardd-ckpt-XXXXXX");
  cr_assert_not_null(mkdtemp(dir));
  char err[256];
  cr_assert_eq(shardd__backend_host_create(2, 64u << 20, &be, err, sizeof err),
               SHARDD_OK);
  shardd__registry_init(&reg, be);
}

static void teardown(void) {
  shardd__registry_free(&reg);
  be->ops->destroy(be);
  rm_tree(dir);
}

static uint32_t rng = 12345;
static uint32_t next_rand(void) {
  rng = rng * 1664525u + 1013904223u;
  return rng >> 8;
}

static void fill_random(void *p, size_t bytes) {
  unsigned char *b = p;
  for (size_t i = 0; i < bytes; i++)
    b[i] = (unsigned char)next_rand();
}

/* A job with an fp32 and a bf16 buffer, views in both, one AdamW over the
 * views and the whole of nothing else; shards and state filled randomly. */
static shardd__job *make_job(const char *name) {
  char err[512];
  shardd__job *job;
  cr_assert_eq(shardd__job_get(&reg, name, 3, 0, &job, err, sizeof err), SHARDD_OK);
  shardd__buffer *a, *b;
  int created;
  cr_assert_eq(shardd__buffer_register(&reg, job, "layer 0/weights", SHARDD_DTYPE_FP32,
                                       1001, &a, &created, err, sizeof err),
               SHARDD_OK, "%s", err);
  cr_assert_eq(shardd__buffer_register(&reg, job, "emb", SHARDD_DTYPE_BF16, 77, &b,
                                       &created, err, sizeof err),
               SHARDD_OK, "%s", err);
  shardd__view *v1, *v2, *v3;
  int64_t s1[2] = {10, 50}, s2[1] = {501}, s3[1] = {77};
  cr_assert_eq(shardd__view_register(&reg, job, a->hdr.id, "w", 0, 500, s1, 2, &v1,
                                     &created, err, sizeof err), SHARDD_OK);
  cr_assert_eq(shardd__view_register(&reg, job, a->hdr.id, "b%ias", 500, 501, s2, 1,
                                     &v2, &created, err, sizeof err), SHARDD_OK);
  cr_assert_eq(shardd__view_register(&reg, job, b->hdr.id, "e", 0, 77, s3, 1, &v3,
                                     &created, err, sizeof err), SHARDD_OK);

  Shardwire__ParamRef r[3], *rp[3];
  uint64_t ids[3] = {v1->hdr.id, v2->hdr.id, v3->hdr.id};
  for (int i = 0; i < 3; i++) {
    shardwire__param_ref__init(&r[i]);
    r[i].id = ids[i];
    rp[i] = &r[i];
  }
  Shardwire__ParamGroup g0 = SHARDWIRE__PARAM_GROUP__INIT, g1 = SHARDWIRE__PARAM_GROUP__INIT;
  Shardwire__HyperParams ov = SHARDWIRE__HYPER_PARAMS__INIT;
  ov.has_amsgrad = 1;
  ov.amsgrad = 1;
  g0.refs = rp;
  g0.n_refs = 2;
  g1.refs = rp + 2;
  g1.n_refs = 1;
  g1.overrides = &ov;
  Shardwire__ParamGroup *gp[2] = {&g0, &g1};
  Shardwire__RegisterOptimizer ro = SHARDWIRE__REGISTER_OPTIMIZER__INIT;
  ro.name = "opt";
  ro.kind = SHARDWIRE__OPTIM_KIND__ADAMW;
  ro.groups = gp;
  ro.n_groups = 2;
  shardd__optim_plan plan;
  char *msg = NULL;
  shardd__optspec spec;
  cr_assert_eq(shardd__optspec_from_wire(&ro, &spec), SHARDD_OK);
  cr_assert_eq(shardd__validate_optimizer(&reg, job, &spec, &plan, &msg), SHARDD_OK,
               "%s", msg ? msg : "");
  shardd__optspec_free(&spec);
  /* the recorded identity is the packed wire message, as checkpoints
   * written before optcodec.h hold it */
  plan.spec_len = shardwire__register_optimizer__get_packed_size(&ro);
  plan.spec = malloc(plan.spec_len);
  shardwire__register_optimizer__pack(&ro, plan.spec);
  shardd__optim *o;
  cr_assert_eq(shardd__optim_create(&reg, job, &plan, &o, err, sizeof err), SHARDD_OK);
  shardd__optim_plan_free(&plan);
  o->steps = 7;
  /* torch's per-parameter step counts: refs skipped by some steps (frozen,
   * or no gradient) took fewer */
  for (size_t k = 0; k < o->nrefs; k++)
    o->ref_steps[k] = 7 - 2 * (uint64_t)k;

  for (uint32_t k = 0; k < 3; k++) {
    fill_random((char *)a->blocks[k]->ptr + a->shard_off, a->shard_numel * 4);
    fill_random((char *)b->blocks[k]->ptr + b->shard_off, b->shard_numel * 2);
  }
  for (size_t i = 0; i < o->nshards; i++) {
    fill_random(o->shards[i].state->ptr, o->shards[i].state->bytes);
    o->shards[i].master_valid = (int)(i % 2);
  }
  return job;
}

/* A byte image of everything a checkpoint must keep. */
typedef struct {
  unsigned char *bytes;
  size_t len;
} image;

static void image_add(image *im, const void *p, size_t n) {
  im->bytes = realloc(im->bytes, im->len + n);
  memcpy(im->bytes + im->len, p, n);
  im->len += n;
}

static image snapshot(shardd__job *job) {
  image im = {NULL, 0};
  shardd__buffer **bufs;
  size_t nb;
  cr_assert_eq(shardd__job_buffers(job, &bufs, &nb), SHARDD_OK);
  for (size_t i = 0; i < nb; i++) {
    shardd__buffer *b = bufs[i];
    image_add(&im, b->hdr.name, strlen(b->hdr.name) + 1);
    for (uint32_t r = 0; r < b->world; r++)
      image_add(&im, (char *)b->blocks[r]->ptr + b->shard_off,
                b->shard_numel * shardd_dtype_size(b->dtype));
    shardd__view **views;
    size_t nv;
    cr_assert_eq(shardd__buffer_views(b, &views, &nv), SHARDD_OK);
    for (size_t k = 0; k < nv; k++) {
      image_add(&im, views[k]->hdr.name, strlen(views[k]->hdr.name) + 1);
      image_add(&im, &views[k]->offset, sizeof views[k]->offset);
      image_add(&im, &views[k]->numel, sizeof views[k]->numel);
      image_add(&im, views[k]->shape, (size_t)views[k]->ndim * sizeof(int64_t));
      cr_assert_not_null(views[k]->owner);
    }
    free(views);
  }
  free(bufs);
  shardd__optim *o = shardd__optim_find(job, "opt");
  cr_assert_not_null(o);
  image_add(&im, &o->steps, sizeof o->steps);
  for (size_t k = 0; k < o->nrefs; k++) {
    image_add(&im, o->refs[k]->name, strlen(o->refs[k]->name) + 1);
    image_add(&im, &o->ref_steps[k], sizeof o->ref_steps[k]);
  }
  for (size_t i = 0; i < o->nshards; i++) {
    image_add(&im, &o->shards[i].master_valid, sizeof(int));
    image_add(&im, o->shards[i].state->ptr, o->shards[i].state->bytes);
  }
  return im;
}

TestSuite(checkpoint, .init = setup, .fini = teardown);

Test(checkpoint, round_trip_keeps_every_byte) {
  char err[1024];
  shardd__job *job = make_job("llm 7b");
  image before = snapshot(job);
  cr_assert_eq(shardd__checkpoint_write(&reg, job, dir, -1, err, sizeof err), SHARDD_OK,
               "%s", err);
  shardd__job_release(&reg, job);
  cr_assert_null(shardd__job_find(&reg, 0, "llm 7b"));

  shardd__job *back;
  cr_assert_eq(shardd__checkpoint_restore(&reg, dir, -1, 0, &back, err, sizeof err),
               SHARDD_OK, "%s", err);
  cr_assert_str_eq(back->name, "llm 7b");
  cr_assert_eq(back->world, 3);
  image after = snapshot(back);
  cr_assert_eq(after.len, before.len);
  cr_assert(memcmp(after.bytes, before.bytes, before.len) == 0);
  free(before.bytes);
  free(after.bytes);

  /* Restoring over a live job is refused and leaves it alone. */
  shardd__job *again;
  cr_assert_eq(shardd__checkpoint_restore(&reg, dir, -1, 0, &again, err, sizeof err),
               SHARDD_E_BUSY);
  cr_assert_eq(shardd__job_find(&reg, 0, "llm 7b"), back);
}

/* The exit checkpoint's way: several jobs at once, their files on libuv's
 * pool (shardd__checkpoint_run_many). Each restores every byte; one whose
 * directory cannot be made fails alone, naming its path, and leaves no
 * file behind it in the others. */
Test(checkpoint, several_jobs_written_at_once_each_keep_every_byte) {
  char err[1024], paths[3][256], block[200];
  const char *names[3] = {"job a", "job b", "job c"};
  snprintf(block, sizeof block, "%s/not-a-directory", dir);
  FILE *f = fopen(block, "w");
  cr_assert_not_null(f);
  fclose(f);
  snprintf(paths[0], sizeof paths[0], "%s/a", dir);
  snprintf(paths[1], sizeof paths[1], "%s/c", block); /* cannot be made */
  snprintf(paths[2], sizeof paths[2], "%s/b", dir);
  shardd__job *jobs[3];
  shardd__ckwrite *ws[3];
  image before[3];
  for (int k = 0; k < 3; k++) {
    jobs[k] = make_job(names[k]);
    before[k] = snapshot(jobs[k]);
    cr_assert_eq(shardd__checkpoint_prepare(&reg, jobs[k], paths[k], -1, NULL,
                                            &ws[k], err, sizeof err),
                 SHARDD_OK, "%s", err);
  }
  uv_loop_t loop;
  cr_assert_eq(uv_loop_init(&loop), 0);
  shardd_err rcs[3];
  static char errs[3][1024];
  shardd__checkpoint_run_many(&loop, ws, 3, rcs, &errs[0][0], sizeof errs[0]);
  cr_assert_eq(uv_loop_close(&loop), 0, "work left on the loop");
  cr_assert_eq(rcs[0], SHARDD_OK, "%s", errs[0]);
  cr_assert_eq(rcs[2], SHARDD_OK, "%s", errs[2]);
  cr_assert_neq(rcs[1], SHARDD_OK);
  cr_assert(strstr(errs[1], block) != NULL, "\"%s\" does not name %s",
            errs[1], block);
  /* every file written in the first pass was made durable and renamed */
  for (int k = 0; k < 3; k += 2) {
    DIR *dh = opendir(paths[k]);
    cr_assert_not_null(dh);
    for (struct dirent *e; (e = readdir(dh)) != NULL;)
      cr_assert(strstr(e->d_name, ".tmp") == NULL, "%s/%s left behind",
                paths[k], e->d_name);
    closedir(dh);
  }
  for (int k = 0; k < 3; k++) {
    cr_assert_eq(shardd__checkpoint_wbytes(ws[k]) > before[k].len / 2, 1);
    shardd__checkpoint_wfree(ws[k]);
    shardd__job_release(&reg, jobs[k]);
  }
  for (int k = 0; k < 3; k += 2) {
    shardd__job *back;
    cr_assert_eq(shardd__checkpoint_restore(&reg, paths[k], -1, 0, &back, err,
                                            sizeof err),
                 SHARDD_OK, "%s", err);
    cr_assert_str_eq(back->name, names[k]);
    image after = snapshot(back);
    cr_assert_eq(after.len, before[k].len);
    cr_assert(memcmp(after.bytes, before[k].bytes, after.len) == 0,
              "%s restored other bytes", names[k]);
    free(after.bytes);
  }
  for (int k = 0; k < 3; k++)
    free(before[k].bytes);
}

/* A backend whose memory the daemon may not touch directly (as cuda's):
 * the host backend with read and write ops that count their bytes and no
 * HOST_MAPPED cap, so checkpoints stage through them. */
static shardd__backend_ops staged_ops;
static size_t staged_read_bytes, staged_write_bytes;

static shardd_err staged_read(shardd__backend *b, shardd__region *r, size_t off,
                              void *dst, size_t bytes) {
  cr_assert_leq(off + bytes, r->bytes);
  memcpy(dst, (const char *)r->ptr + off, bytes);
  staged_read_bytes += bytes;
  return SHARDD_OK;
}

static shardd_err staged_write(shardd__backend *b, shardd__region *r, size_t off,
                               const void *src, size_t bytes) {
  cr_assert_leq(off + bytes, r->bytes);
  memcpy((char *)r->ptr + off, src, bytes);
  staged_write_bytes += bytes;
  return SHARDD_OK;
}

static void use_staged_backend(void) {
  staged_ops = *be->ops;
  staged_ops.read = staged_read;
  staged_ops.write = staged_write;
  be->ops = &staged_ops;
  be->caps &= ~(unsigned)SHARDD__BACKEND_CAP_HOST_MAPPED;
  staged_read_bytes = staged_write_bytes = 0;
}

/* Checkpoints of a backend without host mappings (cuda) stage device
 * memory through the backend's read and write: the round trip keeps every
 * byte, and a restore into another world reshards as on the host. */
Test(checkpoint, device_memory_is_staged_through_the_backend) {
  char err[1024];
  use_staged_backend();
  shardd__job *job = make_job("staged");
  image before = snapshot(job);
  cr_assert_eq(shardd__checkpoint_write(&reg, job, dir, -1, err, sizeof err), SHARDD_OK,
               "%s", err);
  cr_assert_gt(staged_read_bytes, 0, "the payloads were read through the backend");
  shardd__job_release(&reg, job);
  shardd__job *back;
  cr_assert_eq(shardd__checkpoint_restore(&reg, dir, -1, 0, &back, err, sizeof err),
               SHARDD_OK, "%s", err);
  cr_assert_gt(staged_write_bytes, 0, "the loads were written through the backend");
  image after = snapshot(back);
  cr_assert_eq(after.len, before.len);
  cr_assert(memcmp(after.bytes, before.bytes, before.len) == 0);
  /* the shards, element by element, into a world of 2 */
  shardd__buffer *a = shardd__map_get_str(&back->buffers, "layer 0/weights");
  cr_assert_not_null(a);
  float *whole = malloc(a->padded_numel * 4);
  for (uint32_t r = 0; r < a->world; r++)
    memcpy(whole + r * a->shard_numel, (char *)a->blocks[r]->ptr + a->shard_off,
           a->shard_numel * 4);
  shardd__job_release(&reg, back);
  cr_assert_eq(shardd__checkpoint_restore(&reg, dir, -1, 2, &back, err, sizeof err),
               SHARDD_OK, "%s", err);
  a = shardd__map_get_str(&back->buffers, "layer 0/weights");
  cr_assert_eq(a->world, 2);
  for (uint64_t e = 0; e < a->numel; e++) {
    uint64_t r = e / a->shard_numel, i = e % a->shard_numel;
    float got = ((float *)((char *)a->blocks[r]->ptr + a->shard_off))[i];
    cr_assert_eq(memcmp(&got, &whole[e], 4), 0, "element %" PRIu64, e);
  }
  free(whole);
  free(before.bytes);
  free(after.bytes);
}

/* The name of in's data file that starts "prefix-" (each checkpoint tags
 * its files: b0-r0-TAG.shard), in out; "manifest" stays as it is. */
static void data_name(const char *in, const char *prefix, char *out, size_t n) {
  if (strchr(prefix, '.') || !strcmp(prefix, "manifest")) {
    snprintf(out, n, "%s", prefix);
    return;
  }
  DIR *d = opendir(in);
  cr_assert_not_null(d, "%s", in);
  size_t pl = strlen(prefix);
  out[0] = '\0';
  for (struct dirent *e; (e = readdir(d)) != NULL;)
    if (!strncmp(e->d_name, prefix, pl) && e->d_name[pl] == '-')
      snprintf(out, n, "%.*s", (int)(n - 1), e->d_name);
  closedir(d);
  cr_assert(out[0], "no data file %s-* in %s", prefix, in);
}

static void corrupt_and_expect(const char *prefix, long offset) {
  char err[1024], path[512], file[128];
  shardd__job *job = make_job("j");
  cr_assert_eq(shardd__checkpoint_write(&reg, job, dir, -1, err, sizeof err), SHARDD_OK);
  shardd__job_release(&reg, job);
  size_t objects = shardd__map_count(&reg.objects);
  uint64_t used0;
  shardd__device_info info;
  be->ops->device_info(be, 0, &info);
  used0 = info.used_bytes;

  data_name(dir, prefix, file, sizeof file);
  const char *needle = file;
  snprintf(path, sizeof path, "%s/%s", dir, file);
  if (offset >= 0) {
    int fd = open(path, O_RDWR);
    cr_assert(fd >= 0, "%s", path);
    unsigned char c;
    cr_assert_eq(pread(fd, &c, 1, offset), 1);
    c ^= 0x40;
    cr_assert_eq(pwrite(fd, &c, 1, offset), 1);
    close(fd);
  } else {
    cr_assert_eq(truncate(path, -offset), 0);
  }
  shardd__job *back;
  shardd_err rc = shardd__checkpoint_restore(&reg, dir, -1, 0, &back, err, sizeof err);
  cr_assert_neq(rc, SHARDD_OK);
  cr_assert(strstr(err, needle) != NULL, "message \"%s\" lacks \"%s\"", err, needle);
  cr_assert_null(shardd__job_find(&reg, 0, "j"), "nothing may be registered");
  cr_assert_eq(shardd__map_count(&reg.objects), objects);
  be->ops->device_info(be, 0, &info);
  cr_assert_eq(info.used_bytes, used0, "the refused restore freed what it took");
}

Test(checkpoint, flipped_payload_byte_is_refused_naming_the_file) {
  corrupt_and_expect("b1-r2", 64 + 3 + 10);
}

Test(checkpoint, flipped_state_byte_is_refused_naming_the_file) {
  corrupt_and_expect("o0-b0-r1", 200);
}

Test(checkpoint, truncated_shard_is_refused) {
  corrupt_and_expect("b0-r0", -100);
}

/* Files that are each whole and sealed (their own header and CRC are
 * right) but in the wrong place. mutate changes dir and names, in needle,
 * the file the refusal must name. */
static void misplaced_and_expect(void (*mutate)(char *needle, size_t n)) {
  char err[1024], needle[256];
  shardd__job *job = make_job("j");
  cr_assert_eq(shardd__checkpoint_write(&reg, job, dir, -1, err, sizeof err), SHARDD_OK);
  shardd__job_release(&reg, job);
  mutate(needle, sizeof needle);
  size_t objects = shardd__map_count(&reg.objects);
  shardd__device_info info;
  be->ops->device_info(be, 0, &info);
  uint64_t used0 = info.used_bytes;
  shardd__job *back;
  shardd_err rc = shardd__checkpoint_restore(&reg, dir, -1, 0, &back, err, sizeof err);
  cr_assert_neq(rc, SHARDD_OK, "a checkpoint with %s misplaced was restored", needle);
  cr_log_info("refused: %s", err);
  cr_assert(strstr(err, needle) != NULL, "message \"%s\" lacks \"%s\"", err, needle);
  cr_assert_null(shardd__job_find(&reg, 0, "j"), "nothing may be registered");
  cr_assert_eq(shardd__map_count(&reg.objects), objects);
  be->ops->device_info(be, 0, &info);
  cr_assert_eq(info.used_bytes, used0, "the refused restore freed what it took");
  /* and the same registry still restores a sound checkpoint */
  job = make_job("k");
  char dir2[] = "/tmp/shardd-ckpt2-XXXXXX";
  cr_assert_not_null(mkdtemp(dir2));
  cr_assert_eq(shardd__checkpoint_write(&reg, job, dir2, -1, err, sizeof err), SHARDD_OK);
  shardd__job_release(&reg, job);
  cr_assert_eq(shardd__checkpoint_restore(&reg, dir2, -1, 0, &back, err, sizeof err),
               SHARDD_OK, "%s", err);
  rm_tree(dir2);
}

/* Swaps the contents of data files a and b of dir (names stay). */
static void swap_files(const char *pa, const char *pb) {
  char fa[128], fb[128], a[512], b[512], t[600];
  data_name(dir, pa, fa, sizeof fa);
  data_name(dir, pb, fb, sizeof fb);
  snprintf(a, sizeof a, "%s/%s", dir, fa);
  snprintf(b, sizeof b, "%s/%s", dir, fb);
  snprintf(t, sizeof t, "%s.swap", a);
  struct stat sa, sb;
  cr_assert_eq(stat(a, &sa), 0);
  cr_assert_eq(stat(b, &sb), 0);
  cr_assert_eq(sa.st_size, sb.st_size, "%s and %s differ in size: not a swap test", fa, fb);
  cr_assert_eq(rename(a, t), 0);
  cr_assert_eq(rename(b, a), 0);
  cr_assert_eq(rename(t, b), 0);
}

/* the restore reads in rank order: the first of the two is named */
static void swap_two_ranks_shards(char *needle, size_t n) {
  swap_files("b0-r0", "b0-r1");
  data_name(dir, "b0-r0", needle, n);
}

static void swap_two_ranks_state(char *needle, size_t n) {
  swap_files("o0-b0-r1", "o0-b0-r2");
  data_name(dir, "o0-b0-r1", needle, n);
}

Test(checkpoint, two_ranks_shard_files_swapped_are_refused_naming_the_file) {
  misplaced_and_expect(swap_two_ranks_shards);
}

Test(checkpoint, two_ranks_state_files_swapped_are_refused_naming_the_file) {
  misplaced_and_expect(swap_two_ranks_state);
}

/* b1-r2's file replaced by the same file of another checkpoint of the same
 * job (same buffer, rank, size and header; its own CRC right, other data):
 * the manifest's CRC for the file tells them apart. */
static void file_from_another_checkpoint(char *needle, size_t n) {
  char err[512], other[] = "/tmp/shardd-ckpt-other-XXXXXX";
  cr_assert_not_null(mkdtemp(other));
  shardd__job *job = make_job("j"); /* the same job, later: other random data */
  cr_assert_eq(shardd__checkpoint_write(&reg, job, other, -1, err, sizeof err), SHARDD_OK);
  shardd__job_release(&reg, job);
  char mine[128], theirs[128], a[512], b[512];
  data_name(dir, "b1-r2", mine, sizeof mine);
  data_name(other, "b1-r2", theirs, sizeof theirs);
  snprintf(a, sizeof a, "%s/%s", dir, mine);
  snprintf(b, sizeof b, "%s/%s", other, theirs);
  char *x = test_slurp(a), *y = test_slurp(b);
  struct stat sa, sb;
  cr_assert_eq(stat(a, &sa), 0);
  cr_assert_eq(stat(b, &sb), 0);
  cr_assert_eq(sa.st_size, sb.st_size);
  cr_assert_neq(memcmp(x, y, (size_t)sa.st_size), 0, "the two checkpoints hold the same data");
  free(x);
  free(y);
  cr_assert_eq(rename(b, a), 0);
  rm_tree(other);
  snprintf(needle, n, "%s", mine);
}

Test(checkpoint, a_shard_file_from_another_checkpoint_is_refused_naming_the_file) {
  misplaced_and_expect(file_from_another_checkpoint);
}

Test(checkpoint, truncated_manifest_is_refused) {
  char err[1024], path[256];
  shardd__job *job = make_job("j");
  cr_assert_eq(shardd__checkpoint_write(&reg, job, dir, -1, err, sizeof err), SHARDD_OK);
  shardd__job_release(&reg, job);
  snprintf(path, sizeof path, "%s/manifest", dir);
  FILE *f = fopen(path, "r");
  char text[65536];
  size_t n = fread(text, 1, sizeof text - 1, f);
  fclose(f);
  text[n] = '\0';
  char *end = strstr(text, "\nend ");
  cr_assert_not_null(end);
  end++;
  f = fopen(path, "w");
  fwrite(text, 1, (size_t)(end - text), f); /* drop the last line */
  fclose(f);
  cr_assert_gt(n, 0);
  shardd__job *back;
  cr_assert_neq(shardd__checkpoint_restore(&reg, dir, -1, 0, &back, err, sizeof err),
                SHARDD_OK);
  cr_assert(strstr(err, "truncated") != NULL, "%s", err);
  cr_assert_null(shardd__job_find(&reg, 0, "j"));
}

/* ---- manifests that are not what shardd wrote -----------------------------
 * Each rewrites the manifest of make_job("j")'s checkpoint line by line;
 * keep(line, arg) says whether a line stays (it may also append text).
 * The restore must be refused with a message holding every needle, and
 * leave nothing registered. */

typedef int (*line_filter)(const char *line, FILE *out, void *arg);

/* Seals an edited manifest again as shardd does (its "end" line carries
 * the CRC32C of the bytes before it), so a test of what the parser refuses
 * reaches the parser. */
static void reseal(const char *path) {
  char *text = test_slurp(path);
  cr_assert_not_null(text);
  char *end = strstr(text, "\nend ");
  if (end != NULL) {
    uint32_t crc = shardd__crc32c(0, text, (size_t)(end + 1 - text));
    char *rest = strchr(end + 1, '\n');
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fprintf(f, "%.*send %08x\n%s", (int)(end + 1 - text), text, crc,
            rest ? rest + 1 : "");
    fclose(f);
  }
  free(text);
}

static void rewrite_manifest(line_filter keep, void *arg) {
  char err[1024], path[256];
  shardd__job *job = make_job("j");
  cr_assert_eq(shardd__checkpoint_write(&reg, job, dir, -1, err, sizeof err), SHARDD_OK,
               "%s", err);
  shardd__job_release(&reg, job);
  snprintf(path, sizeof path, "%s/manifest", dir);
  char *text = test_slurp(path);
  cr_assert_not_null(text);
  FILE *f = fopen(path, "w");
  cr_assert_not_null(f);
  for (char *save, *line = strtok_r(text, "\n", &save); line;
       line = strtok_r(NULL, "\n", &save))
    if (keep(line, f, arg))
      fprintf(f, "%s\n", line);
  cr_assert_eq(fclose(f), 0);
  free(text);
  reseal(path);
}

/* A version 3 manifest has no per-ref step counts (every step stepped
 * every ref then): each ref restores with its optimizer's count. */
static int as_version_3(const char *line, FILE *out, void *arg) {
  if (!strncmp(line, "shardd-checkpoint ", 18)) {
    fprintf(out, "shardd-checkpoint 3\n");
    return 0;
  }
  if (!strncmp(line, "ref ", 4)) {
    fprintf(out, "%.*s\n", (int)(strrchr(line, ' ') - line), line);
    return 0;
  }
  return 1;
}

Test(checkpoint, per_ref_steps_round_trip_and_version_3_gives_the_optimizers) {
  char err[1024];
  shardd__job *job = make_job("per-ref");
  shardd__optim *o = shardd__optim_find(job, "opt");
  cr_assert_eq(o->nrefs, 3);
  cr_assert_eq(shardd__checkpoint_write(&reg, job, dir, -1, err, sizeof err), SHARDD_OK,
               "%s", err);
  shardd__job_release(&reg, job);
  shardd__job *back;
  cr_assert_eq(shardd__checkpoint_restore(&reg, dir, -1, 0, &back, err, sizeof err),
               SHARDD_OK, "%s", err);
  o = shardd__optim_find(back, "opt");
  cr_assert_not_null(o);
  for (size_t k = 0; k < o->nrefs; k++)
    cr_expect_eq(o->ref_steps[k], 7 - 2 * k, "ref %zu (%s)", k, o->refs[k]->name);
  shardd__job_release(&reg, back);

  rewrite_manifest(as_version_3, NULL);
  cr_assert_eq(shardd__checkpoint_restore(&reg, dir, -1, 0, &back, err, sizeof err),
               SHARDD_OK, "%s", err);
  o = shardd__optim_find(back, "opt");
  cr_assert_not_null(o);
  cr_expect_eq(o->steps, 7);
  for (size_t k = 0; k < o->nrefs; k++)
    cr_expect_eq(o->ref_steps[k], 7, "ref %zu (%s)", k, o->refs[k]->name);
}

static void expect_manifest_refused(const char *const *needles) {
  char err[1024];
  size_t objects = shardd__map_count(&reg.objects);
  shardd__job *back;
  shardd_err rc = shardd__checkpoint_restore(&reg, dir, -1, 0, &back, err, sizeof err);
  cr_assert_eq(rc, SHARDD_E_INVAL, "restore: %s (%s)", shardd_err_name(rc), err);
  for (; *needles; needles++)
    cr_assert(strstr(err, *needles) != NULL, "message \"%s\" lacks \"%s\"", err,
              *needles);
  cr_assert_null(shardd__job_find(&reg, 0, "j"), "nothing may be registered");
  cr_assert_eq(shardd__map_count(&reg.objects), objects);
}

static int drop_shards(const char *line, FILE *out, void *arg) {
  return strncmp(line, "shard ", 6) != 0;
}

/* Buffer lines register zeroed memory and only shard lines fill it: a
 * manifest cut (or edited) down to its registrations restored a job of
 * zeros as if that were the checkpoint. */
Test(checkpoint, manifest_without_shard_lines_is_refused) {
  rewrite_manifest(drop_shards, NULL);
  char path[256];
  snprintf(path, sizeof path, "%s/manifest", dir);
  expect_manifest_refused((const char *const[]){path, "2 buffers but no shard", NULL});
}

static int drop_one_shard(const char *line, FILE *out, void *arg) {
  return strncmp(line, arg, strlen(arg)) != 0;
}

Test(checkpoint, manifest_missing_one_shard_is_refused_naming_it) {
  rewrite_manifest(drop_one_shard, "shard 1 2 "); /* "emb", rank 2 */
  expect_manifest_refused((const char *const[]){"manifest", "\"emb\" rank 2", NULL});
}

static int twice(const char *line, FILE *out, void *arg) {
  if (!strncmp(line, "shard 0 1 ", 10))
    fprintf(out, "%s\n", line);
  return 1;
}

Test(checkpoint, manifest_listing_a_shard_twice_is_refused) {
  rewrite_manifest(twice, NULL);
  expect_manifest_refused((const char *const[]){"manifest line", "listed twice", NULL});
}

/* A line past the cap (four frames: a spec of two in hex; checkpoint.c),
 * here 80 MiB of one token without a newline, which getline took in
 * whole, is refused by its line number. */
static int long_line_after_job(const char *line, FILE *out, void *arg) {
  if (!strncmp(line, "job ", 4)) {
    fprintf(out, "%s\n", line);
    static char chunk[1 << 20];
    memset(chunk, 'x', sizeof chunk);
    for (size_t i = 0; i < 5 * (size_t)SHARDD_MAX_FRAME / sizeof chunk; i++)
      cr_assert_eq(fwrite(chunk, 1, sizeof chunk, out), sizeof chunk);
    *(int *)arg = 1;
    return 0;
  }
  return !*(int *)arg; /* nothing after it */
}

Test(checkpoint, overlong_manifest_line_is_refused_naming_file_and_line) {
  int cut = 0;
  rewrite_manifest(long_line_after_job, &cut);
  expect_manifest_refused((const char *const[]){"manifest line 3", "longer than", NULL});
}

static int nul_in_job_line(const char *line, FILE *out, void *arg) {
  if (!strncmp(line, "job ", 4)) {
    fwrite(line, 1, 4, out);
    fputc('\0', out);
    fprintf(out, "%s\n", line + 4);
    return 0;
  }
  return 1;
}

Test(checkpoint, manifest_line_with_a_nul_byte_is_refused) {
  rewrite_manifest(nul_in_job_line, NULL);
  expect_manifest_refused((const char *const[]){"manifest line 2", "NUL byte", NULL});
}

Test(checkpoint, missing_manifest_is_an_incomplete_checkpoint) {
  char err[1024];
  shardd__job *back;
  cr_assert_eq(shardd__checkpoint_restore(&reg, dir, -1, 0, &back, err, sizeof err),
               SHARDD_E_IO);
  cr_assert(strstr(err, "manifest") != NULL, "%s", err);
}

Test(checkpoint, crc32c_known_answer) {
  /* RFC 3720 B.4: 32 bytes of zeros -> 0x8a9136aa; "123456789" -> 0xe3069283. */
  unsigned char zeros[32] = {0};
  cr_assert_eq(shardd__crc32c(0, zeros, sizeof zeros), 0x8a9136aau);
  cr_assert_eq(shardd__crc32c(0, "123456789", 9), 0xe3069283u);
  /* Chunked equals whole. */
  cr_assert_eq(shardd__crc32c(shardd__crc32c(0, "1234", 4), "56789", 5), 0xe3069283u);
}

/* ---- through the daemon: restore continues training exactly ------------ */

#define WORLD 2
#define MAXW 4
#define NUMEL 1003
#define HALF 301

typedef struct {
  const test_daemon *d;
  uint32_t rank, world;
  int steps;      /* steps to run */
  int first_step; /* gradient seed offset, so both runs see the same grads */
  int global_grad; /* rank 0 writes one global gradient, the others 0, SUM:
                    * the reduced gradient is the same in any world */
  const char *ckpt; /* checkpoint after the steps (rank 0 asks) */
  float *out;     /* NUMEL + HALF floats: the gathered parameters at the end */
  pthread_barrier_t *bar;
  int *progress;  /* not NULL: rank 0 stores the steps it has taken */
} rank_arg;

static void grad_for(int step, uint32_t rank, float *g, uint64_t n) {
  for (uint64_t i = 0; i < n; i++)
    g[i] = (float)((int)((i * 7 + (uint64_t)step * 13 + rank * 5) % 17) - 8) / 16.0f;
}

static uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static float from_bf16(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static void *run_rank(void *p) {
  rank_arg *a = p;
  shardd_client_t *c = test_connect(a->d, "ckpt-job", a->rank, a->world);
  /* every resume (a restore at start, shardctl restore, a relaunch onto
   * the lingering job) tells each rank the step it resumes at; a fresh
   * job is told nothing */
  uint64_t resumed_at;
  int resumed = shardd_resumed(c, &resumed_at);
  cr_assert_eq(resumed, a->first_step > 0, "rank %u: resumed %d at step %" PRIu64
               ", expected %s step %d", a->rank, resumed, resumed_at,
               a->first_step > 0 ? "a resume at" : "no resume before",
               a->first_step);
  if (resumed)
    cr_assert_eq(resumed_at, (uint64_t)a->first_step,
                 "rank %u told it resumes at step %" PRIu64 ", not %d", a->rank,
                 resumed_at, a->first_step);
  shardd_buffer_info b, h;
  cr_assert_eq(shardd_buffer_register(c, "flat", SHARDD_DTYPE_FP32, NUMEL, &b), SHARDD_OK,
               "%s", shardd_last_error(c));
  cr_assert_eq(shardd_buffer_register(c, "half", SHARDD_DTYPE_BF16, HALF, &h), SHARDD_OK,
               "%s", shardd_last_error(c));
  if (a->first_step == 0) { /* a fresh job: each rank fills its own shard */
    for (uint64_t i = 0; i < b.shard_numel; i++) {
      uint64_t g = a->rank * b.shard_numel + i;
      ((float *)b.shard)[i] = g < NUMEL ? (float)g / 100.0f : 0.0f;
    }
    for (uint64_t i = 0; i < h.shard_numel; i++) {
      uint64_t g = a->rank * h.shard_numel + i;
      ((uint16_t *)h.shard)[i] = to_bf16(g < HALF ? (float)g / 64.0f : 0.0f);
    }
  }
  uint64_t v1, v2, v3;
  int64_t s1[1] = {600}, s2[1] = {NUMEL - 600}, s3[1] = {HALF};
  cr_assert_eq(shardd_view_register(c, b.id, "w", 0, 600, s1, 1, &v1), SHARDD_OK);
  cr_assert_eq(shardd_view_register(c, b.id, "b", 600, NUMEL - 600, s2, 1, &v2), SHARDD_OK);
  cr_assert_eq(shardd_view_register(c, h.id, "e", 0, HALF, s3, 1, &v3), SHARDD_OK);
  shardd_param_ref refs[3] = {{v1, "w"}, {v2, "b"}, {v3, "e"}};
  shardd_param_group g[2] = {{refs, 2, {0}},
                             {refs + 2, 1, {.set = SHARDD_HP_AMSGRAD, .amsgrad = 1}}};
  shardd_hparams hp = {.set = SHARDD_HP_LR | SHARDD_HP_WEIGHT_DECAY, .lr = 0.01,
                       .weight_decay = 0.1};
  uint64_t opt;
  cr_assert_eq(shardd_optimizer_register(c, "adamw", SHARDD_OPTIM_ADAMW, &hp, g, 2, &opt),
               SHARDD_OK, "%s", shardd_last_error(c));
  pthread_barrier_wait(a->bar);
  for (int s = 0; s < a->steps; s++) {
    cr_assert_eq(shardd_gather(c, b.id), SHARDD_OK, "%s", shardd_last_error(c));
    if (a->global_grad && a->rank != 0) {
      memset(b.grad, 0, b.padded_numel * 4);
      memset(h.grad, 0, h.padded_numel * 2);
    } else {
      grad_for(a->first_step + s, a->global_grad ? 0 : a->rank, b.grad, b.padded_numel);
      float tmp[HALF + MAXW];
      grad_for(a->first_step + s, a->global_grad ? 0 : a->rank + 1, tmp, h.padded_numel);
      for (uint64_t i = 0; i < h.padded_numel; i++)
        ((uint16_t *)h.grad)[i] = to_bf16(tmp[i]);
    }
    shardd_reduce_op op = a->global_grad ? SHARDD_REDUCE_SUM : SHARDD_REDUCE_MEAN;
    cr_assert_eq(shardd_scatter(c, b.id, op), SHARDD_OK);
    cr_assert_eq(shardd_scatter(c, h.id, op), SHARDD_OK);
    cr_assert_eq(shardd_step(c, opt, NULL, NULL), SHARDD_OK, "%s", shardd_last_error(c));
    if (a->progress && a->rank == 0)
      __atomic_store_n(a->progress, s + 1, __ATOMIC_RELEASE);
  }
  pthread_barrier_wait(a->bar);
  if (a->ckpt && a->rank == 0)
    cr_assert_eq(shardd_checkpoint(c, NULL, a->ckpt), SHARDD_OK, "%s", shardd_last_error(c));
  pthread_barrier_wait(a->bar);
  cr_assert_eq(shardd_gather(c, b.id), SHARDD_OK);
  cr_assert_eq(shardd_gather(c, h.id), SHARDD_OK);
  if (a->out) {
    memcpy(a->out, b.gather, NUMEL * sizeof(float));
    for (uint64_t i = 0; i < HALF; i++)
      a->out[NUMEL + i] = from_bf16(((uint16_t *)h.gather)[i]);
  }
  shardd_close(c);
  return NULL;
}

static void run_world(const test_daemon *d, uint32_t world, int global_grad,
                      int steps, int first, const char *ckpt, float *out) {
  pthread_t t[MAXW];
  rank_arg a[MAXW];
  pthread_barrier_t bar;
  pthread_barrier_init(&bar, NULL, world);
  for (uint32_t r = 0; r < world; r++) {
    a[r] = (rank_arg){d, r, world, steps, first, global_grad, ckpt,
                      r == 0 ? out : NULL, &bar, NULL};
    pthread_create(&t[r], NULL, run_rank, &a[r]);
  }
  for (uint32_t r = 0; r < world; r++)
    pthread_join(t[r], NULL);
  pthread_barrier_destroy(&bar);
}

static void run_job(const test_daemon *d, int steps, int first, const char *ckpt,
                    float *out) {
  run_world(d, WORLD, 0, steps, first, ckpt, out);
}

/* ---- an operator's checkpoint of a live job (issue 19) ----------------- */

#define LIVE_STEPS 400

typedef struct {
  const test_daemon *d;
  int *progress;
  char dirs[2][128];
  int n;         /* checkpoints taken */
  int last;      /* index into dirs of the last one */
  int at_step;   /* rank 0's steps when the last one was asked for */
  shardd_err rc; /* the first failure, or OK */
  char msg[512];
} operator_arg;

/* While the ranks train: `shardctl checkpoint` (as libshardd calls it),
 * again and again, alternating two directories, until 3/4 of the steps. */
static void *operator_run(void *p) {
  operator_arg *a = p;
  shardd_client_t *c = test_connect(a->d, NULL, 0, 0);
  while (__atomic_load_n(a->progress, __ATOMIC_ACQUIRE) < 5)
    test_sleep_ms(1);
  a->rc = SHARDD_OK;
  int at;
  while ((at = __atomic_load_n(a->progress, __ATOMIC_ACQUIRE)) < LIVE_STEPS * 3 / 4) {
    int i = a->n % 2;
    shardd_err rc = shardd_checkpoint_wait(c, "ckpt-job", a->dirs[i], 30);
    if (rc != SHARDD_OK) {
      a->rc = rc;
      snprintf(a->msg, sizeof a->msg, "%s", shardd_last_error(c));
      break;
    }
    a->n++;
    a->last = i;
    a->at_step = at;
    test_sleep_ms(3);
  }
  shardd_close(c);
  return NULL;
}

/* The steps of the (one) optimizer of the daemon's only job. */
static uint64_t job_steps(const test_daemon *d) {
  char cmd[256], *out = NULL, *errs = NULL;
  snprintf(cmd, sizeof cmd, "--socket %s --json status", d->sock);
  cr_assert_eq(test_shardctl(NULL, cmd, &out, &errs), 0, "%s", errs);
  tj *j = tj_parse(out);
  cr_assert_not_null(j, "%s", out);
  const tj *jobs = tj_need(j, "jobs", TJ_ARR);
  cr_assert_eq(jobs->n, 1, "%s", out);
  const tj *opts = tj_need(jobs->kids[0], "optimizers", TJ_ARR);
  cr_assert_eq(opts->n, 1, "%s", out);
  uint64_t steps = (uint64_t)tj_need(opts->kids[0], "steps", TJ_NUM)->num;
  tj_free(j);
  free(out);
  free(errs);
  return steps;
}

/* Two ranks train LIVE_STEPS steps without a pause of their own while an
 * operator checkpoints the job over and over: no checkpoint is refused,
 * no step fails, the parameters equal an uninterrupted run's bit for bit,
 * and the last checkpoint, restored into a new daemon and trained to
 * LIVE_STEPS from the step it recorded, ends there too (it was a
 * consistent cut, taken mid-run). */
Test(checkpoint, operator_checkpoints_of_a_training_job_change_nothing, .timeout = 60) {
  static float straight[NUMEL + HALF], live[NUMEL + HALF], resumed[NUMEL + HALF];
  test_daemon d;
  test_daemon_start(&d, (const char *const[]){"--devices", "2", NULL});
  run_job(&d, LIVE_STEPS, 0, NULL, straight);
  cr_assert_eq(test_daemon_stop(&d), 0);

  test_daemon_start(&d, (const char *const[]){"--devices", "2", "--job-linger",
                                              "600", NULL});
  int progress = 0;
  operator_arg op = {.d = &d, .progress = &progress};
  snprintf(op.dirs[0], sizeof op.dirs[0], "%s/live-a", dir);
  snprintf(op.dirs[1], sizeof op.dirs[1], "%s/live-b", dir);
  pthread_t ot, t[WORLD];
  pthread_create(&ot, NULL, operator_run, &op);
  rank_arg a[WORLD];
  pthread_barrier_t bar;
  pthread_barrier_init(&bar, NULL, WORLD);
  for (uint32_t r = 0; r < WORLD; r++) {
    a[r] = (rank_arg){&d, r, WORLD, LIVE_STEPS, 0, 0, NULL, r == 0 ? live : NULL,
                      &bar, &progress};
    pthread_create(&t[r], NULL, run_rank, &a[r]);
  }
  for (uint32_t r = 0; r < WORLD; r++)
    pthread_join(t[r], NULL);
  pthread_join(ot, NULL);
  pthread_barrier_destroy(&bar);
  cr_assert_eq(op.rc, SHARDD_OK, "checkpoint %d of the live job: %s", op.n + 1, op.msg);
  cr_assert_geq(op.n, 1, "no checkpoint was taken");
  cr_assert_eq(test_daemon_stop(&d), 0);
  for (int i = 0; i < NUMEL + HALF; i++)
    cr_assert_eq(memcmp(&straight[i], &live[i], sizeof(float)), 0,
                 "element %d: %.9g uninterrupted, %.9g with %d checkpoints", i,
                 (double)straight[i], (double)live[i], op.n);

  test_daemon_start(&d, (const char *const[]){"--devices", "2", "--restore",
                                              op.dirs[op.last], NULL});
  uint64_t k = job_steps(&d);
  cr_assert(k >= (uint64_t)op.at_step && k < LIVE_STEPS,
            "the last checkpoint recorded step %llu; asked at step %d of %d",
            (unsigned long long)k, op.at_step, LIVE_STEPS);
  run_job(&d, LIVE_STEPS - (int)k, (int)k, NULL, resumed);
  cr_assert_eq(test_daemon_stop(&d), 0);
  for (int i = 0; i < NUMEL + HALF; i++)
    cr_assert_eq(memcmp(&straight[i], &resumed[i], sizeof(float)), 0,
                 "element %d: %.9g uninterrupted, %.9g resumed from step %llu", i,
                 (double)straight[i], (double)resumed[i], (unsigned long long)k);
  cr_assert(straight[700] != 7.0f, "the parameters moved");
}

/* W ranks train 3 steps and checkpoint; a new daemon restores into W' ranks
 * (shardctl restore --world), which train 2 more: the parameters equal 5
 * uninterrupted steps of W ranks, bit for bit (the global gradient makes the
 * reduced gradient world-independent; the update is elementwise). */
static void reshard_case(uint32_t w, uint32_t w2) {
  static float straight[NUMEL + HALF], resumed[NUMEL + HALF];
  char ck[128], cmd[512];
  snprintf(ck, sizeof ck, "%s/reshard-%u-%u", dir, w, w2);
  test_daemon d;
  test_daemon_start(&d, (const char *const[]){"--devices", "2", NULL});
  run_world(&d, w, 1, 5, 0, NULL, straight);
  cr_assert_eq(test_daemon_stop(&d), 0);

  test_daemon_start(&d, (const char *const[]){"--devices", "2", NULL});
  run_world(&d, w, 1, 3, 0, ck, NULL);
  cr_assert_eq(test_daemon_stop(&d), 0);
  test_daemon_start(&d, (const char *const[]){"--devices", "3", NULL});
  snprintf(cmd, sizeof cmd, "--socket %s restore %s --world %u", d.sock, ck, w2);
  char *out = NULL, *errs = NULL;
  int rc = test_shardctl(NULL, cmd, &out, &errs);
  cr_assert_eq(rc, 0, "shardctl %s: %s %s", cmd, out, errs);
  free(out);
  free(errs);
  run_world(&d, w2, 1, 2, 3, NULL, resumed);
  cr_assert_eq(test_daemon_stop(&d), 0);
  for (int i = 0; i < NUMEL + HALF; i++)
    cr_assert_eq(memcmp(&straight[i], &resumed[i], sizeof(float)), 0,
                 "element %d: %.9g uninterrupted, %.9g after %u -> %u", i,
                 (double)straight[i], (double)resumed[i], w, w2);
  cr_assert(straight[700] != 7.0f, "the parameters moved");
}

Test(checkpoint, reshard_4_to_2_continues_identically, .timeout = 60) {
  reshard_case(4, 2);
}

Test(checkpoint, reshard_2_to_3_continues_identically, .timeout = 60) {
  reshard_case(2, 3);
}

Test(checkpoint, restored_job_continues_bit_identically, .timeout = 60) {
  static float uninterrupted[NUMEL + HALF], resumed[NUMEL + HALF];
  char ck[128];
  snprintf(ck, sizeof ck, "%s/ck", dir);

  /* 5 steps straight through. */
  test_daemon d;
  test_daemon_start(&d, (const char *const[]){"--devices", "2", NULL});
  run_job(&d, 5, 0, NULL, uninterrupted);
  cr_assert_eq(test_daemon_stop(&d), 0);

  /* 3 steps, checkpoint, daemon gone; a new daemon restores; 2 more. */
  test_daemon_start(&d, (const char *const[]){"--devices", "2", NULL});
  run_job(&d, 3, 0, ck, NULL);
  cr_assert_eq(test_daemon_stop(&d), 0);
  test_daemon_start(&d, (const char *const[]){"--devices", "2", "--restore", ck, NULL});
  run_job(&d, 2, 3, NULL, resumed);
  cr_assert_eq(test_daemon_stop(&d), 0);

  for (int i = 0; i < NUMEL + HALF; i++)
    cr_assert_eq(memcmp(&uninterrupted[i], &resumed[i], sizeof(float)), 0,
                 "element %d: %.9g uninterrupted, %.9g resumed", i,
                 (double)uninterrupted[i], (double)resumed[i]);
  /* And the parameters moved: the comparison is not of two untouched buffers. */
  cr_assert_neq(uninterrupted[0], 0.0f);
  cr_assert(uninterrupted[1] != 0.01f);
}

Test(checkpoint, sigterm_with_checkpoint_on_exit_writes_every_job, .timeout = 60) {
  char ck[128], manifest[200];
  snprintf(ck, sizeof ck, "%s/exit", dir);
  test_daemon d;
  test_daemon_start(&d, (const char *const[]){"--checkpoint-on-exit", ck, NULL});
  run_job(&d, 1, 0, NULL, NULL);
  cr_assert_eq(test_daemon_terminate(&d), 0);
  /* the size and pace of the whole, what TimeoutStopSec must cover */
  cr_assert(test_daemon_log_has(&d, "exit checkpoint: 1 of 1 job written, "),
            "no summary line of the exit checkpoint in the log");
  cr_assert(test_daemon_log_has(&d, " MiB/s)"));
  test_daemon_stop(&d);
  snprintf(manifest, sizeof manifest, "%s/ckpt-job/manifest", ck);
  cr_assert_eq(access(manifest, R_OK), 0, "no %s", manifest);
}

/* kill -9: no exit checkpoint, nothing cleaned up; the log is kept for
 * the caller to read (test_daemon_stop removes it). */
static void kill_daemon(test_daemon *d) {
  int st;
  kill(d->pid, SIGKILL);
  waitpid(d->pid, &st, 0);
  d->pid = 0;
}

/* The daemon's only job, or none: its optimizer's steps, -1 without one. */
static int64_t steps_if_any(const test_daemon *d) {
  char cmd[256], *out = NULL, *errs = NULL;
  snprintf(cmd, sizeof cmd, "--socket %s --json status", d->sock);
  cr_assert_eq(test_shardctl(NULL, cmd, &out, &errs), 0, "%s", errs);
  tj *j = tj_parse(out);
  cr_assert_not_null(j, "%s", out);
  const tj *jobs = tj_need(j, "jobs", TJ_ARR);
  int64_t steps = -1;
  if (jobs->n > 0) {
    const tj *opts = tj_need(jobs->kids[0], "optimizers", TJ_ARR);
    steps = (int64_t)tj_need(opts->kids[0], "steps", TJ_NUM)->num;
  }
  tj_free(j);
  free(out);
  free(errs);
  return steps;
}

/* The shipped unit's flags, --checkpoint-on-exit DIR --restore DIR: a
 * restart after SIGTERM resumes at the step the exit checkpoint holds and
 * says so; a kill -9 before any step since restores that checkpoint again
 * (nothing moved past it) and training continues bit for bit; but once the
 * job has stepped past it, a kill -9 (no newer exit checkpoint) must not
 * bring it back in silence: it is not restored, and the log names the job,
 * its step and how to restore it anyway, which works (shardctl restore).
 * A later exit checkpoint into the same directory restores normally, even
 * where the marker survived (a crash between the new manifest and the
 * marker's removal). */
Test(checkpoint, an_exit_checkpoint_stepped_past_is_not_restored_silently,
     .timeout = 90) {
  static float uninterrupted[NUMEL + HALF], resumed[NUMEL + HALF];
  char ck[128], job[200], marker[240], line[512];
  snprintf(ck, sizeof ck, "%s/exit", dir);
  snprintf(job, sizeof job, "%s/ckpt-job", ck);
  snprintf(marker, sizeof marker, "%s/superseded", job);
  const char *const flags[] = {"--devices", "2", "--checkpoint-on-exit", ck,
                               "--restore", ck, NULL};
  test_daemon d;
  test_daemon_start(&d, (const char *const[]){"--devices", "2", NULL});
  run_job(&d, 5, 0, NULL, uninterrupted);
  cr_assert_eq(test_daemon_stop(&d), 0);

  /* 3 steps; systemctl restart (SIGTERM) */
  test_daemon_start(&d, flags);
  run_job(&d, 3, 0, NULL, NULL);
  cr_assert_eq(test_daemon_stop(&d), 0);
  test_daemon_start(&d, flags);
  cr_assert_eq(steps_if_any(&d), 3); /* served: the restore is logged */
  snprintf(line, sizeof line, "job \"ckpt-job\" restored from %s at step 3", job);
  cr_assert(test_daemon_log_has(&d, line), "no \"%s\" in the log", line);
  /* the trainers attach and leave without a step; kill -9 */
  run_job(&d, 0, 3, NULL, NULL);
  kill_daemon(&d);
  test_daemon_stop(&d);
  cr_assert_neq(access(marker, F_OK), 0, "marked superseded without a step");

  /* nothing moved past it: restored again, and training goes on exactly */
  test_daemon_start(&d, flags);
  cr_assert_eq(steps_if_any(&d), 3);
  cr_assert(test_daemon_log_has(&d, line), "no \"%s\" in the log", line);
  run_job(&d, 2, 3, NULL, resumed);
  for (int i = 0; i < NUMEL + HALF; i++)
    cr_assert_eq(memcmp(&uninterrupted[i], &resumed[i], sizeof(float)), 0,
                 "element %d: %.9g uninterrupted, %.9g resumed", i,
                 (double)uninterrupted[i], (double)resumed[i]);
  cr_assert(test_daemon_log_has(&d, "marked superseded"));
  /* at step 5 now; kill -9: the exit checkpoint still holds step 3 */
  kill_daemon(&d);
  test_daemon_stop(&d);
  cr_assert_eq(access(marker, F_OK), 0, "the step did not mark %s", job);

  test_daemon_start(&d, flags);
  cr_assert_eq(steps_if_any(&d), -1, "the superseded step-3 checkpoint came back");
  snprintf(line, sizeof line, "job \"ckpt-job\" in %s not restored", job);
  cr_assert(test_daemon_log_has(&d, line), "no \"%s\" in the log", line);
  cr_assert(test_daemon_log_has(&d, "holds step 3"));
  snprintf(line, sizeof line, "shardctl restore %s", job);
  cr_assert(test_daemon_log_has(&d, line), "no \"%s\" in the log", line);
  cr_assert(test_daemon_log_has(&d, "1 job not restored"));
  /* and again: the marker stays until a newer checkpoint replaces it */
  kill_daemon(&d);
  test_daemon_stop(&d);
  test_daemon_start(&d, flags);
  cr_assert_eq(steps_if_any(&d), -1);

  /* the operator accepts the rollback, as the log says: shardctl restore;
   * the job trains 1 step and stops cleanly: its new exit checkpoint
   * replaces the old one and restores, marker or not */
  char *saved = test_slurp(marker), *out = NULL, *errs = NULL;
  cr_assert_not_null(saved);
  snprintf(line, sizeof line, "--socket %s restore %s", d.sock, job);
  cr_assert_eq(test_shardctl(NULL, line, &out, &errs), 0, "%s%s", out, errs);
  free(out);
  free(errs);
  cr_assert_eq(steps_if_any(&d), 3);
  run_job(&d, 1, 3, NULL, NULL);
  cr_assert_eq(test_daemon_stop(&d), 0);
  FILE *f = fopen(marker, "w");
  cr_assert_not_null(f);
  fputs(saved, f);
  fclose(f);
  free(saved);
  test_daemon_start(&d, flags);
  cr_assert_eq(steps_if_any(&d), 4, "a newer exit checkpoint was not restored");
  cr_assert_eq(test_daemon_stop(&d), 0);
  cr_assert_neq(access(marker, F_OK), 0, "a stale marker was kept");
}

/* Through a daemon: a checkpoint whose two ranks' shard files were swapped
 * (each whole, with its own right CRC) is refused naming the file; the
 * daemon goes on serving, holds no half-restored job, and restores the
 * same checkpoint once the files are back in place, training on from it. */
Test(checkpoint, a_daemon_refuses_swapped_shard_files_and_serves_on, .timeout = 60) {
  char ck[128];
  snprintf(ck, sizeof ck, "%s/swap", dir);
  test_daemon d;
  test_daemon_start(&d, (const char *const[]){"--devices", "2", NULL});
  run_job(&d, 2, 0, ck, NULL);
  cr_assert_eq(test_daemon_stop(&d), 0);
  char fa[128], fb[128], a[300], b[300], t[320];
  data_name(ck, "b0-r0", fa, sizeof fa);
  data_name(ck, "b0-r1", fb, sizeof fb);
  snprintf(a, sizeof a, "%s/%s", ck, fa);
  snprintf(b, sizeof b, "%s/%s", ck, fb);
  snprintf(t, sizeof t, "%s.swap", a);
  struct stat sa, sb;
  cr_assert_eq(stat(a, &sa), 0);
  cr_assert_eq(stat(b, &sb), 0);
  cr_assert_eq(sa.st_size, sb.st_size);
  cr_assert_eq(rename(a, t), 0);
  cr_assert_eq(rename(b, a), 0);
  cr_assert_eq(rename(t, b), 0);

  test_daemon_start(&d, (const char *const[]){"--devices", "2", NULL});
  shardd_client_t *ctl = test_connect(&d, NULL, 0, 1);
  char job[64];
  cr_assert_neq(shardd_restore(ctl, ck, 0, job, sizeof job), SHARDD_OK);
  const char *why = shardd_last_error(ctl);
  cr_log_info("swapped shard files: %s", why);
  cr_assert(strstr(why, fa) != NULL, "\"%s\" does not name %s", why, fa);
  cr_assert_eq(shardd_ping(ctl), SHARDD_OK);
  char *js;
  cr_assert_eq(shardd_status_json(ctl, &js), SHARDD_OK);
  tj *j = tj_parse(js);
  cr_assert_not_null(j);
  cr_assert_eq(tj_need(j, "jobs", TJ_ARR)->n, 0, "a refused restore left a job: %s", js);
  tj_free(j);
  shardd_free(js);
  /* put back: the same checkpoint restores, and the job trains on */
  cr_assert_eq(rename(a, t), 0);
  cr_assert_eq(rename(b, a), 0);
  cr_assert_eq(rename(t, b), 0);
  cr_assert_eq(shardd_restore(ctl, ck, 0, job, sizeof job), SHARDD_OK, "%s",
               shardd_last_error(ctl));
  cr_assert_str_eq(job, "ckpt-job");
  shardd_close(ctl);
  run_job(&d, 1, 2, NULL, NULL);
  cr_assert_eq(test_daemon_stop(&d), 0);
}

Test(checkpoint, checkpoint_root_confines_client_paths, .timeout = 60) {
  char root[128], inside[200];
  snprintf(root, sizeof root, "%s/root", dir);
  cr_assert_eq(mkdir(root, 0750), 0);
  snprintf(inside, sizeof inside, "%s/ok", root);
  test_daemon d;
  test_daemon_start(&d, (const char *const[]){"--checkpoint-root", root, NULL});
  shardd_client_t *c = test_connect(&d, "confined", 0, 1);
  shardd_buffer_info b;
  cr_assert_eq(shardd_buffer_register(c, "x", SHARDD_DTYPE_FP32, 10, &b), SHARDD_OK);
  const char *bad[] = {"/etc/shardd-never", "relative/dir", NULL, NULL};
  char escape[256];
  snprintf(escape, sizeof escape, "%s/../escape", root);
  bad[2] = escape;
  for (int i = 0; bad[i]; i++) {
    cr_assert_eq(shardd_checkpoint(c, NULL, bad[i]), SHARDD_E_PERMISSION, "%s", bad[i]);
    cr_assert_eq(shardd_restore(c, bad[i], 0, NULL, 0), SHARDD_E_PERMISSION, "%s", bad[i]);
  }
  cr_assert_eq(access("/etc/shardd-never", F_OK), -1);
  cr_assert_eq(shardd_checkpoint(c, NULL, inside), SHARDD_OK, "%s", shardd_last_error(c));
  shardd_close(c);
  cr_assert_eq(test_daemon_stop(&d), 0);
}

/* ---- generations and frozen views (issue 9) ---------------------------- */

static shardd__job *make_lora_job(void) {
  char err[512];
  shardd__job *job;
  cr_assert_eq(shardd__job_get(&reg, "lora", 2, 0, &job, err, sizeof err), SHARDD_OK);
  shardd__buffer *b;
  int created;
  cr_assert_eq(shardd__buffer_register(&reg, job, "block0", SHARDD_DTYPE_FP32, 40, &b,
                                       &created, err, sizeof err),
               SHARDD_OK, "%s", err);
  /* a second generation of the name before the checkpoint */
  cr_assert_eq(shardd__buffer_unregister(&reg, job, b->hdr.id, err, sizeof err), SHARDD_OK);
  cr_assert_eq(shardd__buffer_register(&reg, job, "block0", SHARDD_DTYPE_FP32, 40, &b,
                                       &created, err, sizeof err),
               SHARDD_OK, "%s", err);
  cr_assert_eq(b->hdr.generation, 2);
  shardd__view *v;
  int64_t s1[1] = {30}, s2[1] = {10};
  cr_assert_eq(shardd__view_register_ex(&reg, job, b->hdr.id, 0, "base", 0, 30, s1, 1, 0,
                                        &v, &created, err, sizeof err),
               SHARDD_OK, "%s", err);
  cr_assert_eq(shardd__view_register_ex(&reg, job, b->hdr.id, 0, "adapter", 30, 10, s2, 1,
                                        1, &v, &created, err, sizeof err),
               SHARDD_OK, "%s", err);
  return job;
}

static void expect_restored_lora(shardd__job *back, uint64_t buf_gen, uint64_t view_gen,
                                 int frozen_kept) {
  shardd__buffer *b = shardd__map_get_str(&back->buffers, "block0");
  cr_assert_not_null(b);
  cr_expect_eq(b->hdr.generation, buf_gen);
  shardd__view *base = shardd__map_get_str(&b->views, "base");
  shardd__view *ad = shardd__map_get_str(&b->views, "adapter");
  cr_assert_not_null(base);
  cr_assert_not_null(ad);
  cr_expect_eq(base->hdr.generation, view_gen);
  cr_expect_eq(ad->hdr.generation, view_gen);
  cr_expect_eq(base->requires_grad, !frozen_kept);
  cr_expect_eq(ad->requires_grad, 1);
  uint64_t(*fr)[2];
  cr_expect_eq(shardd__buffer_frozen(b, &fr), frozen_kept ? 1 : 0);
  /* registering the name again continues from the restored generation */
  char err[512];
  uint64_t id = b->hdr.id;
  cr_assert_eq(shardd__buffer_unregister(&reg, back, id, err, sizeof err), SHARDD_OK);
  int created;
  cr_assert_eq(shardd__buffer_register(&reg, back, "block0", SHARDD_DTYPE_FP32, 40, &b,
                                       &created, err, sizeof err),
               SHARDD_OK);
  cr_expect_eq(b->hdr.generation, buf_gen + 1);
}

Test(checkpoint, restore_bumps_generations_and_keeps_frozen_views) {
  char err[1024];
  shardd__job *job = make_lora_job();
  cr_assert_eq(shardd__checkpoint_write(&reg, job, dir, -1, err, sizeof err), SHARDD_OK, "%s", err);
  shardd__job_release(&reg, job);
  shardd__job *back;
  cr_assert_eq(shardd__checkpoint_restore(&reg, dir, -1, 0, &back, err, sizeof err),
               SHARDD_OK, "%s", err);
  expect_restored_lora(back, 3, 2, 1);
}

/* Restoring a manifest of 12k frozen views held the loop 15 s: each view
 * line listed the buffer's views and re-sorted every frozen range. Here
 * RZ_N views (frozen [0,8) and [4,16), trainable [16,24) and [20,32) in
 * each 32 elements) are written and restored: the restored buffer's
 * bookkeeping (buf->frozen_probes) stays within 8 log2 N per view plus one
 * pass per read of the ranges (the old way: about N^2 / 4, 16 million at
 * N = 8000, against a bound of about 0.8 million), and the ranges are the
 * same. */
#define RZ_N 8000
#define RZ_LOG2 13 /* ceil(log2(RZ_N)) */
Test(checkpoint, restoring_frozen_views_does_not_grow_with_the_views, .timeout = 300) {
  char err[1024];
  shardd__job *job;
  cr_assert_eq(shardd__job_get(&reg, "frozen", 1, 0, &job, err, sizeof err), SHARDD_OK);
  shardd__buffer *b;
  int created;
  uint64_t numel = (uint64_t)RZ_N / 4 * 32;
  cr_assert_eq(shardd__buffer_register(&reg, job, "flat", SHARDD_DTYPE_FP32, numel, &b,
                                       &created, err, sizeof err),
               SHARDD_OK, "%s", err);
  static const uint64_t o[4] = {0, 4, 16, 20}, l[4] = {8, 12, 8, 12};
  for (size_t i = 0; i < RZ_N; i++) {
    char name[32];
    snprintf(name, sizeof name, "v%zu", i);
    int64_t shape[1] = {(int64_t)l[i % 4]};
    shardd__view *v;
    cr_assert_eq(shardd__view_register_ex(&reg, job, b->hdr.id, 0, name,
                                          (i / 4) * 32 + o[i % 4], l[i % 4], shape, 1,
                                          i % 4 >= 2, &v, &created, err, sizeof err),
                 SHARDD_OK, "%s: %s", name, err);
  }
  cr_assert_eq(shardd__checkpoint_write(&reg, job, dir, -1, err, sizeof err), SHARDD_OK,
               "%s", err);
  shardd__job_release(&reg, job);
  shardd__job *back;
  cr_assert_eq(shardd__checkpoint_restore(&reg, dir, -1, 0, &back, err, sizeof err),
               SHARDD_OK, "%s", err);
  b = shardd__map_get_str(&back->buffers, "flat");
  cr_assert_not_null(b);
  cr_assert_eq(b->nfrozen, RZ_N / 2);
  uint64_t(*fr)[2];
  cr_assert_eq(shardd__buffer_frozen(b, &fr), RZ_N / 4);
  for (size_t g = 0; g < RZ_N / 4; g++)
    cr_assert(fr[g][0] == g * 32 && fr[g][1] == 16, "range %zu is [%" PRIu64 ", +%" PRIu64
              ")", g, fr[g][0], fr[g][1]);
  uint64_t bound = (uint64_t)8 * RZ_N * RZ_LOG2 + RZ_N;
  cr_log_info("restoring %d views looked at %" PRIu64 " nodes and ranges (bound %" PRIu64
              ")", RZ_N, b->frozen_probes, bound);
  cr_expect_leq(b->frozen_probes, bound, "%" PRIu64 " nodes and ranges looked at restoring "
                "%d views", b->frozen_probes, RZ_N);
}

/* Rewrites the manifest as version 1 wrote it (no generation on buffer
 * lines, no generation and requires_grad after a view's shape, a bare
 * "end") or as version 2 did (the generations, a bare "end"), with the
 * optimizer's step count edited. */
static int as_unsealed(const char *line, FILE *out, void *arg) {
  int version = *(int *)arg;
  char *copy = strdup(line);
  if (!strncmp(copy, "shardd-checkpoint ", 18)) {
    fprintf(out, "shardd-checkpoint %d\n", version);
  } else if (!strncmp(copy, "optimizer ", 10)) {
    char *steps = strchr(copy + 12, ' '); /* " STEPS SPEC" after the name */
    fprintf(out, "%.*s 1000%s\n", (int)(steps - copy), copy, strchr(steps + 1, ' '));
  } else {
    int drop = !strncmp(copy, "end ", 4)                      ? 1
               : version == 2                                 ? 0
               : !strncmp(copy, "buffer ", 7)                 ? 1
               : !strncmp(copy, "view ", 5)                   ? 2
                                                              : 0;
    for (int k = 0; k < drop; k++)
      *strrchr(copy, ' ') = '\0';
    if (!strncmp(copy, "ref ", 4)) /* version 4's per-ref steps */
      *strrchr(copy, ' ') = '\0';
    fprintf(out, "%s\n", copy);
  }
  free(copy);
  return 0;
}

/* Versions 1 and 2 carry no seal, so their step counts (or offsets) could
 * be edited and were restored as written: they are refused, saying so. */
Test(checkpoint, an_unsealed_manifest_is_refused_at_every_version) {
  for (int version = 1; version <= 2; version++) {
    char err[1024];
    shardd__job *job = make_job("j");
    cr_assert_eq(shardd__checkpoint_write(&reg, job, dir, -1, err, sizeof err),
                 SHARDD_OK, "%s", err);
    shardd__job_release(&reg, job);
    char path[256];
    snprintf(path, sizeof path, "%s/manifest", dir);
    char *text = test_slurp(path);
    FILE *f = fopen(path, "w");
    for (char *save, *line = strtok_r(text, "\n", &save); line;
         line = strtok_r(NULL, "\n", &save))
      as_unsealed(line, f, &version);
    fclose(f);
    free(text);
    shardd__job *back;
    shardd_err rc = shardd__checkpoint_restore(&reg, dir, -1, 0, &back, err, sizeof err);
    cr_assert_eq(rc, SHARDD_E_INVAL, "version %d: %s (%s)", version,
                 shardd_err_name(rc), err);
    char want[64];
    snprintf(want, sizeof want, "manifest version %d is not sealed", version);
    cr_assert(strstr(err, want) && strstr(err, "manifest line 1"), "%s", err);
    cr_assert_eq(shardd__map_count(&reg.jobs), 0);
  }
}

static int end_unchecked(const char *line, FILE *out, void *arg) {
  if (!strncmp(line, "optimizer 0 ", 12)) {
    const char *steps = strchr(line + 12, ' ');
    fprintf(out, "%.*s 1000%s\n", (int)(steps - line), line, strchr(steps + 1, ' '));
    return 0;
  }
  if (!strncmp(line, "end ", 4)) {
    fprintf(out, " %s\n", line); /* splits into "end CRC" all the same */
    return 0;
  }
  return 1;
}

/* The seal is checked on the line that starts "end "; a line with a
 * leading space split into the same words and ended the manifest with no
 * checksum checked at all. */
Test(checkpoint, an_end_line_the_seal_check_did_not_see_is_refused) {
  rewrite_manifest(end_unchecked, NULL); /* reseal finds no "\nend " */
  const char *needles[] = {"manifest line", "checksum was not checked", NULL};
  expect_manifest_refused(needles);
}

/* ---- a hostile checkpoint directory ----------------------------------------
 * The client names the directory and the daemon reads and writes it with its
 * own rights. A symlink at a temporary name made the daemon truncate and
 * overwrite the file it named (any file the daemon may write); a FIFO named
 * like the manifest or a shard hung the daemon's loop in open(2). */

Test(checkpoint, symlink_at_a_temporary_name_is_not_followed) {
  shardd__job *job = make_job("ln");
  char victim[128], link[256], err[1024];
  snprintf(victim, sizeof victim, "%s.victim", dir);
  FILE *v = fopen(victim, "w");
  cr_assert_not_null(v);
  fputs("precious\n", v);
  fclose(v);
  char ck[128];
  snprintf(ck, sizeof ck, "%s/ck", dir);
  cr_assert_eq(mkdir(ck, 0750), 0);
  const char *names[] = {".manifest.tmp", ".b0-r0.shard.tmp", ".o0-b0-r0.state.tmp"};
  for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
    snprintf(link, sizeof link, "%s/%s", ck, names[i]);
    cr_assert_eq(symlink(victim, link), 0, "symlink: %s", strerror(errno));
  }
  image before = snapshot(job);
  cr_assert_eq(shardd__checkpoint_write(&reg, job, ck, -1, err, sizeof err), SHARDD_OK,
               "%s", err);
  char *text = test_slurp(victim);
  cr_assert_not_null(text);
  cr_expect_str_eq(text, "precious\n", "the daemon wrote through a planted symlink");
  free(text);
  /* and the checkpoint itself is whole */
  shardd__job_release(&reg, job);
  shardd__job *back;
  cr_assert_eq(shardd__checkpoint_restore(&reg, ck, -1, 0, &back, err, sizeof err),
               SHARDD_OK, "%s", err);
  image after = snapshot(back);
  cr_assert_eq(before.len, after.len);
  cr_assert(memcmp(before.bytes, after.bytes, before.len) == 0);
  free(before.bytes);
  free(after.bytes);
  unlink(victim);
}

/* A restore that opens a FIFO for reading without O_NONBLOCK cannot return
 * before a writer opens it, so whether the restore needed a writer is the
 * test, not how long it took. This thread is that writer of last resort: it
 * waits for the restore to return on its own, and only past a deadline
 * (which guards against a hang and nothing else) opens the FIFO whenever a
 * reader holds it, recording that it had to. */
typedef struct {
  const char *path;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int returned; /* the restore returned (set by the test) */
  int unblocked; /* a reader was waiting and this thread let it go */
} fifo_guard;

static int fifo_guard_returned(fifo_guard *g) {
  pthread_mutex_lock(&g->mu);
  int r = g->returned;
  pthread_mutex_unlock(&g->mu);
  return r;
}

static void *fifo_opener(void *p) {
  fifo_guard *g = p;
  struct timespec deadline;
  clock_gettime(CLOCK_REALTIME, &deadline);
  deadline.tv_sec += 20;
  pthread_mutex_lock(&g->mu);
  while (!g->returned && pthread_cond_timedwait(&g->cv, &g->mu, &deadline) == 0)
    ;
  pthread_mutex_unlock(&g->mu);
  /* O_NONBLOCK: the open succeeds only while someone has the FIFO open for
   * reading (else ENXIO), so a restore still on its way is not let through
   * early, just retried for */
  while (!fifo_guard_returned(g)) {
    int fd = open(g->path, O_WRONLY | O_NONBLOCK);
    if (fd >= 0) {
      pthread_mutex_lock(&g->mu);
      g->unblocked = 1;
      pthread_mutex_unlock(&g->mu);
      close(fd);
      break;
    }
    test_sleep_ms(10);
  }
  return NULL;
}

static void expect_fifo_refused(const char *prefix) {
  shardd__job *job = make_job("fifo");
  char err[1024];
  char ck[128], path[512], name[128];
  snprintf(ck, sizeof ck, "%s/ck", dir);
  cr_assert_eq(shardd__checkpoint_write(&reg, job, ck, -1, err, sizeof err), SHARDD_OK,
               "%s", err);
  shardd__job_release(&reg, job);
  data_name(ck, prefix, name, sizeof name);
  snprintf(path, sizeof path, "%s/%s", ck, name);
  cr_assert_eq(unlink(path), 0);
  cr_assert_eq(mkfifo(path, 0600), 0);
  fifo_guard g = {.path = path};
  pthread_mutex_init(&g.mu, NULL);
  pthread_cond_init(&g.cv, NULL);
  pthread_t th;
  cr_assert_eq(pthread_create(&th, NULL, fifo_opener, &g), 0);
  shardd__job *back;
  shardd_err rc = shardd__checkpoint_restore(&reg, ck, -1, 0, &back, err, sizeof err);
  pthread_mutex_lock(&g.mu);
  g.returned = 1;
  pthread_cond_signal(&g.cv);
  pthread_mutex_unlock(&g.mu);
  pthread_join(th, NULL);
  pthread_cond_destroy(&g.cv);
  pthread_mutex_destroy(&g.mu);
  cr_expect_neq(rc, SHARDD_OK);
  cr_expect(strstr(err, name) && strstr(err, "not a regular file"), "%s", err);
  cr_expect(!g.unblocked, "restore blocked opening a FIFO: it returned only once a "
                          "writer opened it");
  cr_expect_null(shardd__job_find(&reg, 0, "fifo"), "a refused restore left the job");
  unlink(path);
}

Test(checkpoint, fifo_manifest_is_refused_without_blocking, .timeout = 60) {
  expect_fifo_refused("manifest");
}

Test(checkpoint, fifo_shard_is_refused_without_blocking, .timeout = 60) {
  expect_fifo_refused("b0-r0");
}

/* ---- security (issue 20) ----------------------------------------------- */

static void write_text(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  cr_assert_not_null(f, "%s", path);
  fputs(text, f);
  fclose(f);
}

/* A manifest with no job line restored nothing and returned OK; both
 * callers then used the NULL job and the daemon died (SIGSEGV). */
/* text, then its seal: "end CRC" as shardd writes it */
static void write_sealed(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  cr_assert_not_null(f, "%s", path);
  fprintf(f, "%send %08x\n", text, shardd__crc32c(0, text, strlen(text)));
  fclose(f);
}

Test(checkpoint, manifest_without_a_job_line_is_refused) {
  const char *texts[] = {"shardd-checkpoint 4\n", "shardd-checkpoint 3\n",
                         "shardd-checkpoint 4\n\n\n"};
  char path[256], err[1024];
  snprintf(path, sizeof path, "%s/manifest", dir);
  for (size_t i = 0; i < sizeof texts / sizeof *texts; i++) {
    write_sealed(path, texts[i]);
    shardd__job *back = (shardd__job *)1;
    shardd_err rc = shardd__checkpoint_restore(&reg, dir, -1, 0, &back, err, sizeof err);
    cr_assert_eq(rc, SHARDD_E_INVAL, "manifest %zu: %s (%s)", i, shardd_err_name(rc), err);
    cr_assert_null(back);
    cr_assert(strstr(err, "no \"job\" line") != NULL, "%s", err);
  }
}

Test(checkpoint, jobless_manifest_neither_kills_a_daemon_nor_stops_its_start,
     .timeout = 60) {
  char path[256];
  snprintf(path, sizeof path, "%s/manifest", dir);
  write_sealed(path, "shardd-checkpoint 4\n");
  /* through a client: refused, and the daemon goes on serving */
  test_daemon d;
  test_daemon_start(&d, NULL);
  shardd_client_t *c = test_connect(&d, "alive", 0, 1);
  cr_assert_eq(shardd_restore(c, dir, 0, NULL, 0), SHARDD_E_INVAL, "%s",
               shardd_last_error(c));
  cr_assert_eq(shardd_ping(c), SHARDD_OK, "the daemon died of a jobless manifest");
  shardd_close(c);
  cr_assert_eq(test_daemon_stop(&d), 0);
  /* at start: skipped and named, and the daemon serves (an exit would be
   * a restart loop under Restart=on-failure) */
  test_daemon_start(&d, (const char *const[]){"--restore", dir, NULL});
  c = test_connect(&d, "alive", 0, 1);
  cr_assert_eq(shardd_ping(c), SHARDD_OK, "%s", shardd_last_error(c));
  shardd_close(c);
  cr_assert(test_daemon_log_has(&d, "1 job not restored"), "the refusal was not logged");
  cr_assert_eq(test_daemon_stop(&d), 0);
}

/* One damaged job in a --restore directory of several costs that job
 * only: the healthy one is restored and continues bit for bit, the other
 * is named in the log, and the daemon serves. A --restore directory that
 * does not exist yet (a unit restoring its own exit checkpoint on its
 * first start) restores nothing and serves. */
Test(checkpoint, a_damaged_job_at_start_costs_only_that_job, .timeout = 60) {
  static float uninterrupted[NUMEL + HALF], resumed[NUMEL + HALF];
  char all[128], ck[160], bad[160], path[200];
  snprintf(all, sizeof all, "%s/exit", dir);
  snprintf(ck, sizeof ck, "%s/good", all);
  snprintf(bad, sizeof bad, "%s/bad", all);
  cr_assert_eq(mkdir(all, 0700), 0);
  cr_assert_eq(mkdir(bad, 0700), 0);
  snprintf(path, sizeof path, "%s/manifest", bad);
  write_text(path, "shardd-checkpoint 2\nend\n");

  test_daemon d;
  test_daemon_start(&d, (const char *const[]){"--devices", "2", NULL});
  run_job(&d, 5, 0, NULL, uninterrupted);
  cr_assert_eq(test_daemon_stop(&d), 0);
  test_daemon_start(&d, (const char *const[]){"--devices", "2", NULL});
  run_job(&d, 3, 0, ck, NULL);
  cr_assert_eq(test_daemon_stop(&d), 0);

  test_daemon_start(&d, (const char *const[]){"--devices", "2", "--restore", all, NULL});
  /* the socket listens before --restore runs: its last line is waited for */
  for (double end = test_mono_s() + TEST_HANG_S;
       !test_daemon_log_has(&d, "not restored"); test_sleep_ms(10))
    cr_assert_lt(test_mono_s(), end, "--restore never said what it skipped");
  cr_assert(test_daemon_log_has(&d, "/bad"), "the damaged job was not named");
  cr_assert(test_daemon_log_has(&d, "1 job not restored"));
  run_job(&d, 2, 3, NULL, resumed);
  cr_assert_eq(test_daemon_stop(&d), 0);
  for (int i = 0; i < NUMEL + HALF; i++)
    cr_assert_eq(memcmp(&uninterrupted[i], &resumed[i], sizeof(float)), 0,
                 "element %d: %.9g uninterrupted, %.9g resumed", i,
                 (double)uninterrupted[i], (double)resumed[i]);

  snprintf(path, sizeof path, "%s/not-yet", dir);
  test_daemon_start(&d, (const char *const[]){"--restore", path, NULL});
  shardd_client_t *c = test_connect(&d, "fresh", 0, 1);
  cr_assert_eq(shardd_ping(c), SHARDD_OK, "%s", shardd_last_error(c));
  shardd_close(c);
  cr_assert_eq(test_daemon_stop(&d), 0);
}

/* A new checkpoint into the directory of the last one used to unlink the
 * old manifest first, so a failure mid-write left nothing restorable. Here
 * the new manifest cannot be written (a directory sits at its temporary
 * name): the write fails and the previous checkpoint restores whole. */
Test(checkpoint, a_failed_write_leaves_the_previous_checkpoint_whole) {
  char ck[128], block[256], sub[300], err[1024];
  snprintf(ck, sizeof ck, "%s/ck", dir);
  shardd__job *job = make_job("keep");
  image first = snapshot(job);
  cr_assert_eq(shardd__checkpoint_write(&reg, job, ck, -1, err, sizeof err), SHARDD_OK,
               "%s", err);
  /* the job moves on, and its next checkpoint fails */
  shardd__buffer **bufs;
  size_t nb;
  cr_assert_eq(shardd__job_buffers(job, &bufs, &nb), SHARDD_OK);
  for (size_t i = 0; i < nb; i++)
    fill_random((char *)bufs[i]->blocks[0]->ptr + bufs[i]->shard_off,
                bufs[i]->shard_numel * shardd_dtype_size(bufs[i]->dtype));
  free(bufs);
  snprintf(block, sizeof block, "%s/.manifest.tmp", ck);
  cr_assert_eq(mkdir(block, 0700), 0);
  snprintf(sub, sizeof sub, "%s/x", block);
  cr_assert_eq(mkdir(sub, 0700), 0);
  cr_assert_neq(shardd__checkpoint_write(&reg, job, ck, -1, err, sizeof err), SHARDD_OK);
  rmdir(sub);
  rmdir(block);
  shardd__job_release(&reg, job);
  shardd__job *back;
  cr_assert_eq(shardd__checkpoint_restore(&reg, ck, -1, 0, &back, err, sizeof err),
               SHARDD_OK, "the previous checkpoint was lost: %s", err);
  image after = snapshot(back);
  cr_assert_eq(first.len, after.len);
  cr_assert(memcmp(first.bytes, after.bytes, first.len) == 0,
            "the restore holds the failed write's values");
  free(first.bytes);
  free(after.bytes);
  /* and the failed write left none of its files behind */
  DIR *d = opendir(ck);
  int files = 0;
  for (struct dirent *e; (e = readdir(d)) != NULL;)
    files += e->d_name[0] != '.';
  closedir(d);
  char probe[300];
  snprintf(probe, sizeof probe, "%s/manifest", ck);
  cr_assert_eq(access(probe, R_OK), 0);
  /* 2 buffers x 4 shards + optimizer states + the manifest: counted by the
   * round trip above; a leftover generation would double the data files */
  cr_assert_lt(files, 2 * 8 + 2 * 8, "%d files: the failed write's stayed", files);
}

/* Item 6: every byte of the manifest is sealed; an edited step count (a
 * silent change of training) is refused naming the manifest. */
Test(checkpoint, an_edited_manifest_is_refused_by_its_checksum) {
  char err[1024], path[256];
  shardd__job *job = make_job("sealed");
  cr_assert_eq(shardd__checkpoint_write(&reg, job, dir, -1, err, sizeof err), SHARDD_OK,
               "%s", err);
  shardd__job_release(&reg, job);
  snprintf(path, sizeof path, "%s/manifest", dir);
  char *text = test_slurp(path);
  cr_assert_not_null(text);
  char *opt = strstr(text, "\noptimizer 0 ");
  cr_assert_not_null(opt, "%s", text);
  char *steps = strchr(opt + 14, ' '); /* after the name: " STEPS " */
  cr_assert_not_null(steps);
  steps[1] = steps[1] == '9' ? '8' : '9';
  write_text(path, text);
  free(text);
  shardd__job *back;
  shardd_err rc = shardd__checkpoint_restore(&reg, dir, -1, 0, &back, err, sizeof err);
  cr_assert_eq(rc, SHARDD_E_INVAL, "%s (%s)", shardd_err_name(rc), err);
  cr_assert(strstr(err, "manifest") && strstr(err, "checksum"), "%s", err);
  cr_assert_null(shardd__job_find(&reg, 0, "sealed"));
  /* and resealed, the same edit restores: the refusal was the checksum's */
  reseal(path);
  cr_assert_eq(shardd__checkpoint_restore(&reg, dir, -1, 0, &back, err, sizeof err),
               SHARDD_OK, "%s", err);
}

/* ---- sizes a checkpoint states ------------------------------------------
 * Every size read from a manifest or a data file is checked against what
 * the daemon holds before anything is allocated or read: a state line
 * claiming 3 GiB for a buffer of 8 elements (the file sparse, its header
 * agreeing) made a restore into another world allocate and read all of it,
 * and the OOM killer took the daemon. */

static long max_rss_kib(void) {
  struct rusage ru;
  cr_assert_eq(getrusage(RUSAGE_SELF, &ru), 0);
  return ru.ru_maxrss;
}

/* Rewrites the manifest's state line of optimizer 0, buffer 0, rank 0 to
 * claim `claim` bytes and replaces its file with a sparse one whose header
 * says the same; returns the file's name in file. */
static void claim_state_bytes(uint64_t claim, char *file, size_t n) {
  char err[1024], path[512];
  shardd__job *job = make_job("j");
  cr_assert_eq(shardd__checkpoint_write(&reg, job, dir, -1, err, sizeof err), SHARDD_OK,
               "%s", err);
  shardd__job_release(&reg, job);
  snprintf(path, sizeof path, "%s/manifest", dir);
  char *text = test_slurp(path);
  cr_assert_not_null(text);
  FILE *f = fopen(path, "w");
  cr_assert_not_null(f);
  int found = 0;
  for (char *save, *line = strtok_r(text, "\n", &save); line;
       line = strtok_r(NULL, "\n", &save)) {
    char fname[128];
    unsigned mv, nstate;
    if (sscanf(line, "state 0 0 0 %u %127s %*x %*u %u", &mv, fname, &nstate) == 3) {
      fprintf(f, "state 0 0 0 %u %s 00000000 %" PRIu64 " %u\n", mv, fname, claim,
              nstate);
      snprintf(file, n, "%s", fname);
      found = 1;
    } else {
      fprintf(f, "%s\n", line);
    }
  }
  cr_assert_eq(fclose(f), 0);
  free(text);
  cr_assert(found, "no state line of buffer 0 rank 0");
  reseal(path);
  /* the file: a header that agrees with the claim, then a hole */
  const char *name = "layer 0/weights";
  uint8_t head[64] = {0};
  memcpy(head, "SHRDCKPT", 8);
  uint64_t v[5] = {SHARDD_CHECKPOINT_VERSION | (uint64_t)SHARDD_DTYPE_FP32 << 32,
                   claim / 4, 0, claim, (uint64_t)strlen(name) << 32};
  for (int i = 0; i < 5; i++)
    for (int k = 0; k < 8; k++)
      head[8 + 8 * i + k] = (uint8_t)(v[i] >> (8 * k));
  snprintf(path, sizeof path, "%s/%s", dir, file);
  int fd = open(path, O_WRONLY | O_TRUNC);
  cr_assert(fd >= 0, "%s", path);
  cr_assert_eq(write(fd, head, sizeof head), (ssize_t)sizeof head);
  cr_assert_eq(write(fd, name, strlen(name)), (ssize_t)strlen(name));
  cr_assert_eq(ftruncate(fd, (off_t)(sizeof head + strlen(name) + claim)), 0);
  close(fd);
}

Test(checkpoint, a_state_file_claiming_more_than_its_buffer_is_refused_unread) {
  const uint64_t claim = 256ull << 20;
  char file[128], want[64];
  claim_state_bytes(claim, file, sizeof file);
  snprintf(want, sizeof want, "%" PRIu64 " bytes", claim);
  /* into another world (where the file was read whole into a buffer of
   * its size) and into the same one */
  uint32_t worlds[2] = {2, 0};
  for (int i = 0; i < 2; i++) {
    char err[1024];
    long before = max_rss_kib();
    shardd__job *back;
    shardd_err rc =
        shardd__checkpoint_restore(&reg, dir, -1, worlds[i], &back, err, sizeof err);
    cr_assert_eq(rc, SHARDD_E_INVAL, "world %u: %s (%s)", worlds[i],
                 shardd_err_name(rc), err);
    cr_assert(strstr(err, file) && strstr(err, want) && strstr(err, "holds"),
              "world %u: the message names neither the file nor both sizes: %s",
              worlds[i], err);
    cr_assert_lt(max_rss_kib() - before, 32 << 10,
                 "world %u: the restore grew by %ld KiB for a refused file", worlds[i],
                 max_rss_kib() - before);
    cr_assert_null(shardd__job_find(&reg, 0, "j"));
  }
}

static int huge_world(const char *line, FILE *out, void *arg) {
  if (strncmp(line, "job ", 4))
    return 1;
  fprintf(out, "job j 4294967295 0\n"); /* a bit per old rank per buffer line */
  return 0;
}

static int ref_twice(const char *line, FILE *out, void *arg) {
  if (!strncmp(line, "ref 0 ", 6))
    fprintf(out, "%s\n", line);
  return 1;
}

/* Moves each optimizer's ref lines below its state lines (arg: a
 * char[8192] holding the refs withheld so far). */
static int states_first(const char *line, FILE *out, void *arg) {
  char *held = arg;
  if (!strncmp(line, "ref ", 4)) {
    snprintf(held + strlen(held), 8192 - strlen(held), "%s\n", line);
    return 0;
  }
  if (strncmp(line, "state ", 6)) {
    fputs(held, out);
    held[0] = '\0';
  }
  return 1;
}

/* What a restore keeps per line is bounded by what the daemon registered:
 * an old world past any job's, a ref line repeated, or state lines of
 * buffers no ref line above named, are refused. */
Test(checkpoint, a_manifest_asking_more_than_its_job_holds_is_refused) {
  char err[1024];
  shardd__job *back;
  rewrite_manifest(huge_world, NULL);
  shardd_err rc = shardd__checkpoint_restore(&reg, dir, -1, 2, &back, err, sizeof err);
  cr_assert_eq(rc, SHARDD_E_INVAL, "%s (%s)", shardd_err_name(rc), err);
  cr_assert(strstr(err, "world 4294967295 is out of range"), "%s", err);
  rewrite_manifest(ref_twice, NULL);
  rc = shardd__checkpoint_restore(&reg, dir, -1, 0, &back, err, sizeof err);
  cr_assert_eq(rc, SHARDD_E_INVAL, "%s (%s)", shardd_err_name(rc), err);
  cr_assert(strstr(err, "a second ref line"), "%s", err);
  cr_assert_null(shardd__job_find(&reg, 0, "j"));
  /* each optimizer's states moved above its refs */
  char held[8192] = "";
  rewrite_manifest(states_first, held);
  rc = shardd__checkpoint_restore(&reg, dir, -1, 0, &back, err, sizeof err);
  cr_assert_eq(rc, SHARDD_E_INVAL, "%s (%s)", shardd_err_name(rc), err);
  cr_assert(strstr(err, "which no ref line of optimizer 0 above names"), "%s", err);
}

/* A symlink anywhere in the path (here: inside what would be the root)
 * points the daemon's rights elsewhere; the walk refuses it, both ways. */
Test(checkpoint, a_symlink_in_the_path_is_refused) {
  char real[128], link[128], via[200], err[1024];
  snprintf(real, sizeof real, "%s/elsewhere", dir);
  snprintf(link, sizeof link, "%s/link", dir);
  cr_assert_eq(mkdir(real, 0750), 0);
  cr_assert_eq(symlink(real, link), 0);
  snprintf(via, sizeof via, "%s/ck", link);
  shardd__job *job = make_job("ln2");
  cr_assert_eq(shardd__checkpoint_write(&reg, job, via, 1000, err, sizeof err),
               SHARDD_E_PERMISSION, "%s", err);
  cr_assert(strstr(err, "symlink") != NULL, "%s", err);
  cr_assert_eq(shardd__checkpoint_write(&reg, job, link, -1, err, sizeof err),
               SHARDD_E_PERMISSION, "%s", err);
  char probe[300];
  snprintf(probe, sizeof probe, "%s/ck", real);
  cr_assert_eq(access(probe, F_OK), -1, "written through the symlink");
  snprintf(probe, sizeof probe, "%s/manifest", real);
  cr_assert_eq(access(probe, F_OK), -1, "written through the symlink");
  /* a real checkpoint read through a symlinked directory: refused too */
  cr_assert_eq(shardd__checkpoint_write(&reg, job, real, -1, err, sizeof err), SHARDD_OK,
               "%s", err);
  shardd__job_release(&reg, job);
  shardd__job *back;
  cr_assert_eq(shardd__checkpoint_restore(&reg, link, 1000, 0, &back, err, sizeof err),
               SHARDD_E_PERMISSION, "%s", err);
}

/* The attack of item 2: the attacker's own directory, its own manifest,
 * and a shard file that is a symlink (or a hard link) to the victim's
 * checkpoint: the daemon must not open it on the attacker's behalf. */
Test(checkpoint, a_linked_data_file_is_not_read_for_a_client) {
  if (geteuid() != 0)
    cr_skip_test("needs root to own the victim's files as another uid would");
  char victim[128], mine[128], err[1024], name[128], from[400], to[400];
  snprintf(victim, sizeof victim, "%s/victim", dir);
  snprintf(mine, sizeof mine, "%s/mine", dir);
  shardd__job *job = make_job("secret");
  cr_assert_eq(shardd__checkpoint_write(&reg, job, victim, -1, err, sizeof err),
               SHARDD_OK, "%s", err);
  shardd__job_release(&reg, job);
  /* the attacker (uid 4242) copies the manifest into its directory and
   * links one shard to the victim's file */
  cr_assert_eq(mkdir(mine, 0700), 0);
  cr_assert_eq(chown(mine, 4242, 4242), 0);
  DIR *d = opendir(victim);
  for (struct dirent *e; (e = readdir(d)) != NULL;) {
    if (e->d_name[0] == '.')
      continue;
    snprintf(from, sizeof from, "%s/%s", victim, e->d_name);
    snprintf(to, sizeof to, "%s/%s", mine, e->d_name);
    char *text = test_slurp(from);
    cr_assert_not_null(text);
    if (!strcmp(e->d_name, "manifest")) {
      /* claim the job as the attacker's */
      char *uid = strstr(text, " 0\n");
      cr_assert_not_null(uid);
      char *fixed = malloc(strlen(text) + 8);
      snprintf(fixed, strlen(text) + 8, "%.*s 4242\n%s", (int)(uid - text), text, uid + 3);
      write_text(to, fixed);
      reseal(to);
      free(fixed);
      cr_assert_eq(chown(to, 4242, 4242), 0);
    }
    free(text);
  }
  closedir(d);
  data_name(victim, "b0-r0", name, sizeof name);
  snprintf(from, sizeof from, "%s/%s", victim, name);
  snprintf(to, sizeof to, "%s/%s", mine, name);
  for (int kind = 0; kind < 2; kind++) {
    unlink(to);
    cr_assert_eq(kind ? link(from, to) : symlink(from, to), 0, "%s", strerror(errno));
    shardd__job *back;
    shardd_err rc = shardd__checkpoint_restore(&reg, mine, 4242, 0, &back, err, sizeof err);
    cr_assert_eq(rc, SHARDD_E_PERMISSION, "%s link: %s (%s)", kind ? "hard" : "sym",
                 shardd_err_name(rc), err);
    cr_assert(strstr(err, "dtype") == NULL && strstr(err, "CRC") == NULL, "%s", err);
    cr_assert_null(shardd__job_find(&reg, 4242, "secret"));
  }
  /* and the victim's directory itself is not the attacker's to restore */
  cr_assert_eq(chown(victim, 7777, 7777), 0);
  shardd__job *back;
  cr_assert_eq(shardd__checkpoint_restore(&reg, victim, 4242, 0, &back, err, sizeof err),
               SHARDD_E_PERMISSION, "%s", err);
}

/* The owner line of a manifest is only text. Uid 1001 checkpoints its own
 * job "weights" into its own directory, then rewrites the manifest to say
 * the job is uid 1002's: root restoring that directory (an operator's
 * --restore, or root's Restore) must not create uid 1002's job with uid
 * 1001's weights. The recorded owner is believed where the directory and
 * the files are that owner's or the daemon's (this process stands for the
 * daemon: root); the same checkpoint in the victim's own directory, or the
 * attacker's claiming the attacker, restores. */
static shardd__job *owned_job(const char *name, uint32_t uid) {
  char err[512];
  shardd__job *job;
  cr_assert_eq(shardd__job_get(&reg, name, 2, uid, &job, err, sizeof err), SHARDD_OK,
               "%s", err);
  shardd__buffer *b;
  int created;
  cr_assert_eq(shardd__buffer_register(&reg, job, "w", SHARDD_DTYPE_FP32, 64, &b,
                                       &created, err, sizeof err),
               SHARDD_OK, "%s", err);
  for (uint32_t k = 0; k < 2; k++)
    fill_random((char *)b->blocks[k]->ptr + b->shard_off, b->shard_numel * 4);
  return job;
}

/* Rewrites the owner on path's job line (" FROM\n" -> " TO\n"), sealed
 * again, the file then owned by file_uid. */
static void claim_owner(const char *path, unsigned from, unsigned to, uid_t file_uid) {
  char *text = test_slurp(path);
  cr_assert_not_null(text);
  char was[32];
  snprintf(was, sizeof was, " %u\n", from);
  char *at = strstr(text, was);
  cr_assert_not_null(at, "%s", text);
  size_t len = strlen(text) + 32;
  char *fixed = malloc(len);
  snprintf(fixed, len, "%.*s %u\n%s", (int)(at - text), text, to, at + strlen(was));
  unlink(path); /* the daemon's file, in the writer's directory: replaced */
  write_text(path, fixed);
  reseal(path);
  cr_assert_eq(chown(path, file_uid, file_uid), 0);
  free(fixed);
  free(text);
}

Test(checkpoint, root_believes_a_recorded_owner_only_from_that_owners_files) {
  if (geteuid() != 0)
    cr_skip_test("needs root to stand for two uids and the daemon");
  char mine[128], manifest[200], err[1024];
  snprintf(mine, sizeof mine, "%s/mine", dir);
  cr_assert_eq(mkdir(mine, 0700), 0);
  cr_assert_eq(chown(mine, 1001, 1001), 0);
  shardd__job *job = owned_job("weights", 1001);
  cr_assert_eq(shardd__checkpoint_write(&reg, job, mine, 1001, err, sizeof err),
               SHARDD_OK, "%s", err);
  shardd__job_release(&reg, job);
  snprintf(manifest, sizeof manifest, "%s/manifest", mine);
  claim_owner(manifest, 1001, 1002, 1001);
  for (int64_t as = -1; as <= 0; as++) { /* --restore at start; root's Restore */
    shardd__job *back = NULL;
    shardd_err rc = shardd__checkpoint_restore(&reg, mine, as, 0, &back, err, sizeof err);
    cr_assert_eq(rc, SHARDD_E_PERMISSION, "as %d: %s: %s", (int)as, shardd_err_name(rc),
                 err);
    cr_assert(strstr(err, "uid 1002") && strstr(err, "uid 1001"), "%s", err);
    cr_assert_null(shardd__job_find(&reg, 1002, "weights"));
  }
  /* the manifest put back as the daemon's file: the directory still says
   * whose checkpoint it is */
  cr_assert_eq(chown(manifest, 0, 0), 0);
  shardd__job *back = NULL;
  cr_assert_eq(shardd__checkpoint_restore(&reg, mine, 0, 0, &back, err, sizeof err),
               SHARDD_E_PERMISSION, "%s", err);
  cr_assert(strstr(err, "its directory belongs to uid 1001"), "%s", err);
  cr_assert_null(shardd__job_find(&reg, 1002, "weights"));
  /* the claim honest (the attacker's own job): restores, as uid 1001's */
  claim_owner(manifest, 1002, 1001, 1001);
  cr_assert_eq(shardd__checkpoint_restore(&reg, mine, 0, 0, &back, err, sizeof err),
               SHARDD_OK, "%s", err);
  cr_assert_eq(back->uid, 1001u);
  shardd__job_release(&reg, back);
  /* and a directory and files that are uid 1002's restore as 1002's */
  claim_owner(manifest, 1001, 1002, 1002);
  cr_assert_eq(chown(mine, 1002, 1002), 0);
  cr_assert_eq(shardd__checkpoint_restore(&reg, mine, 0, 0, &back, err, sizeof err),
               SHARDD_OK, "%s", err);
  cr_assert_eq(back->uid, 1002u);
  shardd__job_release(&reg, back);
  /* but not with a data file of another uid's in it */
  char name[128], path[300];
  data_name(mine, "b0-r1", name, sizeof name);
  snprintf(path, sizeof path, "%s/%s", mine, name);
  cr_assert_eq(chown(path, 1001, 1001), 0);
  cr_assert_eq(shardd__checkpoint_restore(&reg, mine, -1, 0, &back, err, sizeof err),
               SHARDD_E_PERMISSION, "%s", err);
  cr_assert(strstr(err, name), "%s", err);
  cr_assert_null(shardd__job_find(&reg, 1002, "weights"));
}

/* A multi-node job manifest's owner likewise: root reads the job (and
 * picks the job's --job-spec by it) only from a directory and manifest of
 * that owner or the daemon. */
Test(checkpoint, a_job_manifest_records_an_owner_only_from_that_owners_files) {
  if (geteuid() != 0)
    cr_skip_test("needs root to stand for two uids and the daemon");
  char jd[128], path[200], err[1024];
  snprintf(jd, sizeof jd, "%s/job", dir);
  cr_assert_eq(mkdir(jd, 0700), 0);
  snprintf(path, sizeof path, "%s/manifest", jd);
  write_text(path, "shardd-job-checkpoint 1\njob vj 4 1002\nnodes 2\n"
                   "part 0 node-0 0badc0de\npart 1 node-1 0badc0de\nend 00000000\n");
  reseal(path);
  shardd__ckjob cj;
  cr_assert_eq(chown(jd, 1001, 1001), 0);
  cr_assert_eq(chown(path, 1001, 1001), 0);
  for (int64_t as = -1; as <= 0; as++) {
    shardd_err rc = shardd__checkpoint_read_job(jd, as, &cj, err, sizeof err);
    cr_assert_eq(rc, SHARDD_E_PERMISSION, "as %d: %s: %s", (int)as, shardd_err_name(rc),
                 err);
    cr_assert(strstr(err, "uid 1002") && strstr(err, "uid 1001"), "%s", err);
  }
  /* the daemon's manifest in uid 1001's directory: still not uid 1002's */
  cr_assert_eq(chown(path, 0, 0), 0);
  cr_assert_eq(shardd__checkpoint_read_job(jd, 0, &cj, err, sizeof err),
               SHARDD_E_PERMISSION, "%s", err);
  /* uid 1002's directory: its job */
  cr_assert_eq(chown(jd, 1002, 1002), 0);
  cr_assert_eq(shardd__checkpoint_read_job(jd, 0, &cj, err, sizeof err), SHARDD_OK, "%s",
               err);
  cr_assert_eq(cj.uid, 1002u);
  cr_assert_eq(cj.nodes, 2u);
}

/* Item 3: a client checkpoints its own job only into a directory of its
 * own (or one the daemon makes inside one of its own). */
Test(checkpoint, a_client_cannot_checkpoint_into_another_users_directory) {
  if (geteuid() != 0)
    cr_skip_test("needs root to stand for two uids");
  char victim[128], inside[200], mine[128], mine_ck[200], err[1024];
  snprintf(victim, sizeof victim, "%s/victim", dir);
  snprintf(inside, sizeof inside, "%s/ck", victim);
  cr_assert_eq(mkdir(victim, 0777), 0); /* even a writable one */
  cr_assert_eq(chown(victim, 7777, 7777), 0);
  shardd__job *job = make_job("attack");
  cr_assert_eq(shardd__checkpoint_write(&reg, job, victim, 4242, err, sizeof err),
               SHARDD_E_PERMISSION, "%s", err);
  cr_assert_eq(shardd__checkpoint_write(&reg, job, inside, 4242, err, sizeof err),
               SHARDD_E_PERMISSION, "%s", err);
  cr_assert_eq(access(inside, F_OK), -1, "a directory was made in the victim's");
  char probe[300];
  snprintf(probe, sizeof probe, "%s/manifest", victim);
  cr_assert_eq(access(probe, F_OK), -1);
  /* its own: allowed, and the new directory is handed to it */
  snprintf(mine, sizeof mine, "%s/mine", dir);
  snprintf(mine_ck, sizeof mine_ck, "%s/ck", mine);
  cr_assert_eq(mkdir(mine, 0700), 0);
  cr_assert_eq(chown(mine, 4242, 4242), 0);
  cr_assert_eq(shardd__checkpoint_write(&reg, job, mine_ck, 4242, err, sizeof err),
               SHARDD_OK, "%s", err);
  struct stat st;
  cr_assert_eq(stat(mine_ck, &st), 0);
  cr_assert_eq(st.st_uid, 4242u);
  /* and again into the same directory (replacing its own checkpoint) */
  cr_assert_eq(shardd__checkpoint_write(&reg, job, mine_ck, 4242, err, sizeof err),
               SHARDD_OK, "%s", err);
  shardd__job_release(&reg, job);
}

/* Replacing a checkpoint removes the previous one's data files, and only
 * those: a client's own files in its directory stay. */
Test(checkpoint, replacing_a_checkpoint_removes_only_its_own_files) {
  char ck[128], path[300], err[1024];
  snprintf(ck, sizeof ck, "%s/ck", dir);
  cr_assert_eq(mkdir(ck, 0750), 0);
  const char *mine[] = {"backup.state", "b1-r0-notes.shard", "o1.state", "bx-r0.shard"};
  for (size_t i = 0; i < sizeof mine / sizeof *mine; i++) {
    snprintf(path, sizeof path, "%s/%s", ck, mine[i]);
    write_text(path, "mine\n");
  }
  shardd__job *job = make_job("twice");
  cr_assert_eq(shardd__checkpoint_write(&reg, job, ck, -1, err, sizeof err), SHARDD_OK, "%s", err);
  char first[128];
  data_name(ck, "b0-r0", first, sizeof first);
  cr_assert_eq(shardd__checkpoint_write(&reg, job, ck, -1, err, sizeof err), SHARDD_OK, "%s", err);
  snprintf(path, sizeof path, "%s/%s", ck, first);
  cr_assert_eq(access(path, F_OK), -1, "the previous generation's %s stayed", first);
  for (size_t i = 0; i < sizeof mine / sizeof *mine; i++) {
    snprintf(path, sizeof path, "%s/%s", ck, mine[i]);
    cr_assert_eq(access(path, F_OK), 0, "the client's %s was removed", mine[i]);
  }
  shardd__job_release(&reg, job);
  shardd__job *back;
  cr_assert_eq(shardd__checkpoint_restore(&reg, ck, -1, 0, &back, err, sizeof err),
               SHARDD_OK, "%s", err);
}

/* A write killed mid-file leaves its data file's temporary (".NAME.tmp":
 * a generation of its own, which no later write names): the next
 * checkpoint into the directory removes it, and only such temporaries. */
Test(checkpoint, a_killed_writes_temporaries_go_with_the_next_checkpoint) {
  char ck[128], path[300], err[1024];
  snprintf(ck, sizeof ck, "%s/ck", dir);
  cr_assert_eq(mkdir(ck, 0750), 0);
  const char *stale[] = {".b0-r0-0badf00d.shard.tmp", ".o0-b1-r1-0badf00d.state.tmp"};
  const char *mine[] = {".notes.tmp", ".b0-r0-notes.shard.tmp", "b0-r0-0badf00d.shard.tmp"};
  for (size_t i = 0; i < 2; i++) {
    snprintf(path, sizeof path, "%s/%s", ck, stale[i]);
    write_text(path, "half\n");
  }
  for (size_t i = 0; i < 3; i++) {
    snprintf(path, sizeof path, "%s/%s", ck, mine[i]);
    write_text(path, "mine\n");
  }
  shardd__job *job = make_job("killed");
  cr_assert_eq(shardd__checkpoint_write(&reg, job, ck, -1, err, sizeof err), SHARDD_OK, "%s", err);
  for (size_t i = 0; i < 2; i++) {
    snprintf(path, sizeof path, "%s/%s", ck, stale[i]);
    cr_assert_eq(access(path, F_OK), -1, "the killed write's %s stayed", stale[i]);
  }
  for (size_t i = 0; i < 3; i++) {
    snprintf(path, sizeof path, "%s/%s", ck, mine[i]);
    cr_assert_eq(access(path, F_OK), 0, "the client's %s was removed", mine[i]);
  }
  shardd__job_release(&reg, job);
}

/* A checkpoint that fails on the pool (here: its directory is a file)
 * is logged, naming the job, the directory and why, not only answered. */
Test(checkpoint, a_failed_checkpoint_is_logged, .timeout = 60) {
  char file[128], cmd[512], *out = NULL, *errs = NULL;
  snprintf(file, sizeof file, "%s/not-a-dir", dir);
  write_text(file, "x\n");
  test_daemon d;
  test_daemon_start(&d, NULL);
  shardd_client_t *c = test_connect(&d, "failing", 0, 1);
  shardd_buffer_info b;
  cr_assert_eq(shardd_buffer_register(c, "flat", SHARDD_DTYPE_FP32, 100, &b), SHARDD_OK);
  snprintf(cmd, sizeof cmd, "--socket %s checkpoint failing %s/sub", d.sock, file);
  cr_assert_neq(test_shardctl(NULL, cmd, &out, &errs), 0, "%s", out);
  free(out);
  free(errs);
  snprintf(cmd, sizeof cmd, "checkpoint of job \"failing\" to %s/sub failed", file);
  cr_assert(test_daemon_log_has(&d, cmd), "no \"%s\" in the log", cmd);
  shardd_close(c);
  cr_assert_eq(test_daemon_stop(&d), 0);
}

/* ---- the loop is not held up by a checkpoint (issue 20, item 10) ------- */

/* A 1.6 GB checkpoint froze every client for 4.9 s (the file I/O ran on
 * the loop thread) and made another job's gather time out. Here a job with
 * a 256 MiB buffer is checkpointed with a Ping and a registration sent
 * behind it in the same write, so all three are dispatched in one loop
 * turn: the Pong and the refusal (the job may not change while it is being
 * written) must come before the checkpoint's reply, and so must the Pong of
 * another client asked meanwhile. Orders of replies, never times. The
 * checkpoint then restores byte for byte. */
#define BIG_NUMEL ((uint64_t)64 << 20) /* fp32: 256 MiB */

static uint32_t big_word(uint64_t i) { return (uint32_t)(i * 2654435761u) ^ 0x5bd1e995u; }

/* Appends req, framed, to buf at *len (seq taken from r). */
static void frame_append(test_raw *r, Shardwire__Request *req, uint8_t *buf,
                         size_t cap, size_t *len) {
  req->seq = ++r->seq;
  size_t n = shardwire__request__get_packed_size(req);
  cr_assert_leq(*len + SHARDD_FRAME_HEADER + n, cap);
  shardd__frame_put_header(buf + *len, (uint32_t)n);
  shardwire__request__pack(req, buf + *len + SHARDD_FRAME_HEADER);
  *len += SHARDD_FRAME_HEADER + n;
}

Test(checkpoint, a_large_checkpoint_leaves_the_loop_to_other_clients, .timeout = 60) {
  char ck[128];
  snprintf(ck, sizeof ck, "%s/big", dir);
  test_daemon d;
  test_daemon_start(&d, (const char *const[]){"--backend", "host", "--device-memory",
                                              "3G", NULL});
  test_raw a, b;
  test_raw_open(&d, &a);
  test_raw_hello(&a, "big", 0, 1);
  shardd_buffer_info info;
  test_raw_register_buffer(&a, "flat", SHARDD_DTYPE_FP32, BIG_NUMEL, &info);
  for (uint64_t i = 0; i < BIG_NUMEL; i++)
    ((uint32_t *)info.shard)[i] = big_word(i);
  test_raw_open(&d, &b);
  test_raw_hello(&b, NULL, 0, 0);

  uint8_t buf[4096];
  size_t len = 0;
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Checkpoint cp = SHARDWIRE__CHECKPOINT__INIT;
  cp.dir = ck;
  req.body_case = SHARDWIRE__REQUEST__BODY_CHECKPOINT;
  req.checkpoint = &cp;
  frame_append(&a, &req, buf, sizeof buf, &len);
  uint64_t s_ck = req.seq;
  Shardwire__Request ping = SHARDWIRE__REQUEST__INIT;
  Shardwire__Ping p = SHARDWIRE__PING__INIT;
  ping.body_case = SHARDWIRE__REQUEST__BODY_PING;
  ping.ping = &p;
  frame_append(&a, &ping, buf, sizeof buf, &len);
  uint64_t s_ping = ping.seq;
  Shardwire__Request rv = SHARDWIRE__REQUEST__INIT;
  Shardwire__RegisterView v = SHARDWIRE__REGISTER_VIEW__INIT;
  int64_t shape[1] = {8};
  v.buffer = info.id;
  v.name = "late";
  v.numel = 8;
  v.n_shape = 1;
  v.shape = shape;
  rv.body_case = SHARDWIRE__REQUEST__BODY_REGISTER_VIEW;
  rv.register_view = &v;
  frame_append(&a, &rv, buf, sizeof buf, &len);
  uint64_t s_view = rv.seq;
  test_raw_send_bytes(&a, buf, len);

  Shardwire__Response *resp = test_raw_expect(&a, s_ping, SHARDD_OK);
  cr_assert_eq(resp->body_case, SHARDWIRE__RESPONSE__BODY_PONG);
  shardwire__response__free_unpacked(resp, NULL);
  resp = test_raw_expect(&a, s_view, SHARDD_E_BUSY);
  cr_expect_str_eq(resp->message, "job \"big\" is being checkpointed");
  shardwire__response__free_unpacked(resp, NULL);
  /* another client, while the 256 MiB are still being written */
  test_raw_sync(&b);
  struct pollfd pf = {a.fd, POLLIN, 0};
  cr_expect_eq(poll(&pf, 1, 0), 0,
               "the checkpoint's reply came before another client's Pong");
  resp = test_raw_expect(&a, s_ck, SHARDD_OK);
  cr_assert_eq(resp->body_case, SHARDWIRE__RESPONSE__BODY_CHECKPOINT);
  cr_expect_str_eq(resp->checkpoint->job, "big");
  cr_expect_eq(resp->checkpoint->buffers, 1);
  shardwire__response__free_unpacked(resp, NULL);
  /* and the job takes registrations again */
  test_raw_sync(&a);
  test_raw_close(&a);
  test_raw_close(&b);
  cr_assert_eq(test_daemon_stop(&d), 0);

  test_daemon_start(&d, (const char *const[]){"--backend", "host", "--device-memory",
                                              "3G", "--restore", ck, NULL});
  test_raw_open(&d, &a);
  test_raw_hello(&a, "big", 0, 1);
  test_raw_register_buffer(&a, "flat", SHARDD_DTYPE_FP32, BIG_NUMEL, &info);
  cr_assert_eq(info.created, 0, "attached to the restored buffer");
  uint64_t bad = 0;
  for (uint64_t i = 0; i < BIG_NUMEL; i++)
    bad += ((uint32_t *)info.shard)[i] != big_word(i);
  cr_expect_eq(bad, 0, "%llu words differ after restore", (unsigned long long)bad);
  test_raw_close(&a);
  cr_assert_eq(test_daemon_stop(&d), 0);
}

/* The client that asked leaves while its checkpoint is being written, and
 * under --job-linger 0 its job would go with it: the reply is dropped, the
 * files are still written, and the job is released only after them. */
Test(checkpoint, a_client_leaving_mid_checkpoint_keeps_its_job_until_written,
     .timeout = 60) {
  char ck[128];
  snprintf(ck, sizeof ck, "%s/gone", dir);
  const uint64_t numel = (uint64_t)16 << 20; /* fp32: 64 MiB */
  test_daemon d;
  test_daemon_start(&d, (const char *const[]){"--backend", "host", "--device-memory",
                                              "1G", "--job-linger", "0", NULL});
  test_raw a;
  test_raw_open(&d, &a);
  test_raw_hello(&a, "gone", 0, 1);
  shardd_buffer_info info;
  test_raw_register_buffer(&a, "flat", SHARDD_DTYPE_FP32, numel, &info);
  for (uint64_t i = 0; i < numel; i++)
    ((uint32_t *)info.shard)[i] = big_word(i);
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Checkpoint cp = SHARDWIRE__CHECKPOINT__INIT;
  cp.dir = ck;
  req.body_case = SHARDWIRE__REQUEST__BODY_CHECKPOINT;
  req.checkpoint = &cp;
  test_raw_send(&a, &req);
  test_raw_close(&a);
  for (double end = test_mono_s() + TEST_HANG_S;
       !test_daemon_log_has(&d, "job \"gone\" released");) {
    cr_assert_lt(test_mono_s(), end, "the job was never released");
    test_sleep_ms(10);
  }
  char *log = test_slurp(d.log);
  cr_assert_not_null(log);
  const char *written = strstr(log, "job \"gone\" checkpointed to");
  const char *released = strstr(log, "job \"gone\" released");
  cr_expect(written != NULL && written < released,
            "the job was released before its checkpoint was written:\n%s", log);
  free(log);
  cr_assert_eq(test_daemon_stop(&d), 0);

  test_daemon_start(&d, (const char *const[]){"--backend", "host", "--device-memory",
                                              "1G", "--restore", ck, NULL});
  test_raw_open(&d, &a);
  test_raw_hello(&a, "gone", 0, 1);
  test_raw_register_buffer(&a, "flat", SHARDD_DTYPE_FP32, numel, &info);
  uint64_t bad = 0;
  for (uint64_t i = 0; i < numel; i++)
    bad += ((uint32_t *)info.shard)[i] != big_word(i);
  cr_expect_eq(bad, 0, "%llu words differ after restore", (unsigned long long)bad);
  test_raw_close(&a);
  cr_assert_eq(test_daemon_stop(&d), 0);
}

/* Restore, as the write (issue 20, item 10): the payloads of a large
 * checkpoint are read off the loop thread, so another client's Pong comes
 * before the restore's reply, and while they load the job is refused to
 * whoever would join or checkpoint it. Orders of replies, never times.
 * The restored values are the checkpoint's, byte for byte, and a daemon
 * stopped mid-load still exits cleanly. */
/* Whether dir holds a data file's temporary: a write on the pool is under
 * way. */
static int writing_in(const char *path) {
  DIR *dh = opendir(path);
  int hit = 0;
  if (dh == NULL)
    return 0;
  for (struct dirent *e; !hit && (e = readdir(dh)) != NULL;)
    hit = e->d_name[0] == '.' && strstr(e->d_name, ".tmp") != NULL;
  closedir(dh);
  return hit;
}

/* SIGTERM while `shardctl checkpoint` waits for its files: the checkpoint
 * is written whole, and shardctl says so and exits 0 (it printed E_CLOSED
 * and exited 3 for a valid checkpoint); the daemon then exits 0 and the
 * checkpoint restores byte for byte. */
Test(checkpoint, sigterm_during_an_operators_checkpoint_still_answers_it,
     .timeout = 60) {
  char ck[128], outp[160], cmd[512];
  snprintf(ck, sizeof ck, "%s/term", dir);
  snprintf(outp, sizeof outp, "%s/shardctl.out", dir);
  const uint64_t numel = BIG_NUMEL;
  test_daemon d;
  test_daemon_start(&d, (const char *const[]){"--backend", "host", "--device-memory",
                                              "2G", NULL});
  test_raw a;
  test_raw_open(&d, &a);
  test_raw_hello(&a, "term", 0, 1);
  shardd_buffer_info info;
  test_raw_register_buffer(&a, "flat", SHARDD_DTYPE_FP32, numel, &info);
  for (uint64_t i = 0; i < numel; i++)
    ((uint32_t *)info.shard)[i] = big_word(i);
  pid_t ctl = fork();
  cr_assert_geq(ctl, 0);
  if (ctl == 0) {
    snprintf(cmd, sizeof cmd, "exec %s --socket %s checkpoint term %s >%s 2>&1",
             test_bin("SHARDCTL_BIN", "build/shardctl"), d.sock, ck, outp);
    execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
    _exit(127);
  }
  int st;
  for (double end = test_mono_s() + TEST_HANG_S; !writing_in(ck);) {
    cr_assert_eq(waitpid(ctl, &st, WNOHANG), 0, "shardctl ended before the "
                 "write was seen under way");
    cr_assert_lt(test_mono_s(), end, "the checkpoint never started writing");
    test_sleep_ms(1);
  }
  kill(d.pid, SIGTERM);
  cr_assert(test_wait_exit(ctl, &st), "shardctl hangs");
  char *said = test_slurp(outp);
  cr_assert_not_null(said);
  cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "shardctl exited %d: %s",
            WIFEXITED(st) ? WEXITSTATUS(st) : -1, said);
  snprintf(cmd, sizeof cmd, "term: %s", ck);
  cr_expect(strstr(said, cmd) != NULL, "shardctl said: %s", said);
  free(said);
  int code = -1;
  cr_assert(test_wait_exit(d.pid, &st), "the daemon did not exit");
  code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  d.pid = 0;
  cr_assert_eq(code, 0, "the daemon exited %d", code);
  test_raw_close(&a);
  test_daemon_stop(&d);

  test_daemon_start(&d, (const char *const[]){"--backend", "host", "--device-memory",
                                              "2G", "--restore", ck, NULL});
  test_raw_open(&d, &a);
  test_raw_hello(&a, "term", 0, 1);
  test_raw_register_buffer(&a, "flat", SHARDD_DTYPE_FP32, numel, &info);
  uint64_t bad = 0;
  for (uint64_t i = 0; i < numel; i++)
    bad += ((uint32_t *)info.shard)[i] != big_word(i);
  cr_expect_eq(bad, 0, "%llu words differ after restore", (unsigned long long)bad);
  test_raw_close(&a);
  cr_assert_eq(test_daemon_stop(&d), 0);
}

static uint64_t send_restore(test_raw *r, const char *path) {
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Restore rs = SHARDWIRE__RESTORE__INIT;
  rs.dir = (char *)path;
  req.body_case = SHARDWIRE__REQUEST__BODY_RESTORE;
  req.restore = &rs;
  return test_raw_send(r, &req);
}

/* Waits until r's Status lists job: a restore's manifest is read on the
 * pool, and its job registered (as being restored) once it is read. */
static void wait_job_listed(test_raw *r, const char *job) {
  for (double end = test_mono_s() + TEST_HANG_S;; test_sleep_ms(2)) {
    Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
    Shardwire__StatusRequest st = SHARDWIRE__STATUS_REQUEST__INIT;
    req.body_case = SHARDWIRE__REQUEST__BODY_STATUS;
    req.status = &st;
    Shardwire__Response *resp = test_raw_expect(r, test_raw_send(r, &req), SHARDD_OK);
    int found = 0;
    for (size_t i = 0; i < resp->status->n_jobs; i++)
      found |= !strcmp(resp->status->jobs[i]->name, job);
    shardwire__response__free_unpacked(resp, NULL);
    if (found)
      return;
    cr_assert_lt(test_mono_s(), end, "job \"%s\" was never registered", job);
  }
}

Test(checkpoint, a_large_restore_leaves_the_loop_to_other_clients, .timeout = 60) {
  char ck[128], ck2[128];
  snprintf(ck, sizeof ck, "%s/bigr", dir);
  snprintf(ck2, sizeof ck2, "%s/bigr2", dir);
  const char *const args[] = {"--backend", "host", "--device-memory", "3G", NULL};
  test_daemon d;
  test_daemon_start(&d, args);
  test_raw a, b, e;
  test_raw_open(&d, &a);
  test_raw_hello(&a, "bigr", 0, 1);
  shardd_buffer_info info;
  test_raw_register_buffer(&a, "flat", SHARDD_DTYPE_FP32, BIG_NUMEL, &info);
  for (uint64_t i = 0; i < BIG_NUMEL; i++)
    ((uint32_t *)info.shard)[i] = big_word(i);
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Checkpoint cp = SHARDWIRE__CHECKPOINT__INIT;
  cp.dir = ck;
  req.body_case = SHARDWIRE__REQUEST__BODY_CHECKPOINT;
  req.checkpoint = &cp;
  shardwire__response__free_unpacked(
      test_raw_expect(&a, test_raw_send(&a, &req), SHARDD_OK), NULL);
  test_raw_close(&a);
  cr_assert_eq(test_daemon_stop(&d), 0);

  test_daemon_start(&d, args);
  test_raw_open(&d, &a);
  test_raw_hello(&a, NULL, 0, 0);
  test_raw_open(&d, &b);
  test_raw_open(&d, &e);
  test_raw_hello(&e, NULL, 0, 0);
  /* the Restore, then a Ping behind it on the same connection: the Pong
   * says the restore was taken; once Status lists the job, its manifest
   * was read and applied and the load started */
  uint64_t s_rs = send_restore(&a, ck);
  uint64_t s_ping = test_raw_send_ping(&a);
  Shardwire__Response *resp = test_raw_expect(&a, s_ping, SHARDD_OK);
  cr_assert_eq(resp->body_case, SHARDWIRE__RESPONSE__BODY_PONG);
  shardwire__response__free_unpacked(resp, NULL);
  wait_job_listed(&e, "bigr");
  /* while the 256 MiB load: nobody joins the job, nobody checkpoints it */
  resp = test_raw_expect(&b, test_raw_send_hello(&b, SHARDD_PROTOCOL_VERSION,
                                                 "bigr", 0, 1),
                         SHARDD_E_BUSY);
  cr_expect_str_eq(resp->message, "job \"bigr\" is being restored");
  shardwire__response__free_unpacked(resp, NULL);
  cp.dir = ck2;
  cp.job = "bigr";
  resp = test_raw_expect(&e, test_raw_send(&e, &req), SHARDD_E_BUSY);
  cr_expect_str_eq(resp->message, "job \"bigr\" is being restored");
  shardwire__response__free_unpacked(resp, NULL);
  /* another client, while the payload is still being read */
  test_raw_sync(&e);
  struct pollfd pf = {a.fd, POLLIN, 0};
  cr_expect_eq(poll(&pf, 1, 0), 0,
               "the restore's reply came before another client's Pong");
  resp = test_raw_expect(&a, s_rs, SHARDD_OK);
  cr_assert_eq(resp->body_case, SHARDWIRE__RESPONSE__BODY_CHECKPOINT);
  cr_expect_str_eq(resp->checkpoint->job, "bigr");
  cr_expect_eq(resp->checkpoint->buffers, 1);
  shardwire__response__free_unpacked(resp, NULL);
  /* loaded: the refused client joins now, and finds every byte */
  test_raw_hello(&b, "bigr", 0, 1);
  test_raw_register_buffer(&b, "flat", SHARDD_DTYPE_FP32, BIG_NUMEL, &info);
  cr_assert_eq(info.created, 0, "attached to the restored buffer");
  uint64_t bad = 0;
  for (uint64_t i = 0; i < BIG_NUMEL; i++)
    bad += ((uint32_t *)info.shard)[i] != big_word(i);
  cr_expect_eq(bad, 0, "%llu words differ after restore", (unsigned long long)bad);
  test_raw_close(&a);
  test_raw_close(&b);
  test_raw_close(&e);
  cr_assert_eq(test_daemon_stop(&d), 0);

  /* stopped while it loads: the daemon waits for the load, then exits */
  test_daemon_start(&d, args);
  test_raw_open(&d, &a);
  test_raw_hello(&a, NULL, 0, 0);
  s_rs = send_restore(&a, ck);
  test_raw_sync(&a);
  cr_assert_eq(test_daemon_stop(&d), 0, "a daemon stopped mid-restore failed");
  test_raw_close(&a);
}

/* A manifest is read, its seal checked and its lines split on libuv's
 * pool, not on the loop thread: a 1.5 GB manifest froze every client for
 * 4-6 s. Here 96 MiB of lines under a wrong seal, which used to be read
 * and refused on the loop thread before the next frame was looked at: the
 * Ping sent behind the Restore is answered first now, and another client's
 * Ping too, while the manifest is still being read. Orders, never times. */
static void write_big_manifest(const char *path, size_t bytes) {
  FILE *f = fopen(path, "w");
  cr_assert_not_null(f);
  fputs("shardd-checkpoint 4\n", f);
  char line[128];
  int n = snprintf(line, sizeof line, "view 0 filler 0 1 1 1 0 0 %*s\n", 60, "x");
  for (size_t done = 0; done < bytes; done += (size_t)n)
    fwrite(line, 1, (size_t)n, f);
  fputs("end 00000000\n", f);
  cr_assert_eq(fclose(f), 0);
}

Test(checkpoint, a_large_manifest_is_read_off_the_loop, .timeout = 120) {
  char ck[128], man[160];
  snprintf(ck, sizeof ck, "%s/bigman", dir);
  cr_assert_eq(mkdir(ck, 0700), 0);
  snprintf(man, sizeof man, "%s/manifest", ck);
  write_big_manifest(man, (size_t)96 << 20);
  test_daemon d;
  test_daemon_start(&d, (const char *const[]){"--backend", "host", NULL});
  test_raw a, e;
  test_raw_open(&d, &a);
  test_raw_hello(&a, NULL, 0, 0);
  test_raw_open(&d, &e);
  test_raw_hello(&e, NULL, 0, 0);
  /* both frames in flight at once: the loop takes the Restore first */
  uint64_t s_rs = send_restore(&a, ck);
  uint64_t s_ping = test_raw_send_ping(&a);
  Shardwire__Response *resp = test_raw_recv(&a);
  cr_assert_not_null(resp);
  cr_assert_eq(resp->seq, s_ping, "the Restore's reply (%s) came before the "
               "Ping sent behind it: the manifest was read on the loop thread",
               resp->message ? resp->message : "ok");
  cr_assert_eq(resp->body_case, SHARDWIRE__RESPONSE__BODY_PONG);
  shardwire__response__free_unpacked(resp, NULL);
  /* another client is served while the manifest is read */
  test_raw_sync(&e);
  struct pollfd pf = {a.fd, POLLIN, 0};
  cr_expect_eq(poll(&pf, 1, 0), 0,
               "the restore's reply came before another client's Pong");
  resp = test_raw_expect(&a, s_rs, SHARDD_E_INVAL);
  cr_expect(strstr(resp->message, "checksum 00000000") != NULL,
            "not refused by its seal: %s", resp->message);
  shardwire__response__free_unpacked(resp, NULL);
  /* the refused restore left nothing: the daemon serves on */
  test_raw_sync(&e);
  test_raw_close(&a);
  test_raw_close(&e);
  cr_assert_eq(test_daemon_stop(&d), 0);
}

/* A manifest larger than SHARDD__MANIFEST_MAX is refused on its size,
 * before a byte of it is read or held, naming the bound; so is one part of
 * a multi-node job's checkpoint. Sparse files: a terabyte costs nothing
 * on disk, and a daemon that read it would run out of memory instead. */
Test(checkpoint, a_manifest_past_the_bound_is_refused_unread, .timeout = 60) {
  char ck[128], man[160], want[64];
  snprintf(ck, sizeof ck, "%s/hugeman", dir);
  cr_assert_eq(mkdir(ck, 0700), 0);
  snprintf(man, sizeof man, "%s/manifest", ck);
  snprintf(want, sizeof want, "the %zu MiB a manifest may have",
           SHARDD__MANIFEST_MAX >> 20);
  const off_t sizes[] = {(off_t)SHARDD__MANIFEST_MAX + 1, (off_t)1 << 40};
  test_daemon d;
  test_daemon_start(&d, (const char *const[]){"--backend", "host", NULL});
  test_raw a;
  test_raw_open(&d, &a);
  test_raw_hello(&a, NULL, 0, 0);
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
    int fd = open(man, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    cr_assert_geq(fd, 0);
    const char head[] = "shardd-checkpoint 4\njob big 1 0\n";
    cr_assert_eq(write(fd, head, sizeof head - 1), (ssize_t)sizeof head - 1);
    cr_assert_eq(ftruncate(fd, sizes[i]), 0);
    close(fd);
    Shardwire__Response *resp =
        test_raw_expect(&a, send_restore(&a, ck), SHARDD_E_LIMIT);
    cr_expect(strstr(resp->message, want) != NULL && strstr(resp->message, man),
              "the refusal names neither the bound nor the file: %s",
              resp->message);
    shardwire__response__free_unpacked(resp, NULL);
  }
  test_raw_close(&a);
  cr_assert_eq(test_daemon_stop(&d), 0);
  /* in process, as --restore at start reads it: the same refusal */
  char err[512];
  shardd__job *back;
  cr_assert_eq(shardd__checkpoint_restore(&reg, ck, -1, 0, &back, err, sizeof err),
               SHARDD_E_LIMIT, "%s", err);
  cr_expect(strstr(err, want) != NULL, "%s", err);
}

/* ---- --checkpoint-root per uid (issue 20, item 4) ----------------------- */

/* In a child that becomes uid: a job "mine" with one buffer (job: 1), then
 * checkpoint to dir (restore: 0) or restore from it (restore: 1). Exit
 * code: the shardd_err of that request, 200+ when a step before failed;
 * the daemon's message goes to msg_fd. */
static int ck_as(const char *sock, uid_t uid, int restore, const char *path,
                 int msg_fd) {
  if (setgid(uid) != 0 || setuid(uid) != 0)
    return 200;
  shardd_connect_opts o = SHARDD_CONNECT_OPTS_INIT;
  o.job = restore ? NULL : "mine";
  shardd_client_t *c;
  char err[512];
  if (shardd_connect(sock, &o, &c, err, sizeof err) != SHARDD_OK)
    return 201;
  shardd_buffer_info b;
  if (!restore && shardd_buffer_register(c, "x", SHARDD_DTYPE_FP32, 10, &b) != SHARDD_OK)
    return 202;
  shardd_err rc = restore ? shardd_restore(c, path, 0, NULL, 0)
                          : shardd_checkpoint(c, NULL, path);
  const char *m = shardd_last_error(c);
  if (write(msg_fd, m, strlen(m)) < 0)
    return 203;
  shardd_close(c);
  return (int)rc;
}

/* Runs ck_as in a child; returns its code, and its message in msg. */
static int ck_child(const test_daemon *d, uid_t uid, int restore, const char *path,
                    char *msg, size_t len) {
  int fds[2];
  cr_assert_eq(pipe(fds), 0);
  pid_t pid = fork();
  cr_assert(pid >= 0);
  if (pid == 0) {
    close(fds[0]);
    _exit(ck_as(d->sock, uid, restore, path, fds[1]));
  }
  close(fds[1]);
  ssize_t n = read(fds[0], msg, len - 1);
  msg[n > 0 ? n : 0] = '\0';
  close(fds[0]);
  int st;
  cr_assert(test_wait_exit(pid, &st), "the uid %d child did not finish", (int)uid);
  cr_assert(WIFEXITED(st), "the uid %d child died", (int)uid);
  cr_assert_lt(WEXITSTATUS(st), 200, "uid %d: step %d failed", (int)uid, WEXITSTATUS(st));
  return WEXITSTATUS(st);
}

Test(checkpoint, checkpoint_root_gives_each_uid_its_own_directory, .timeout = 60) {
  if (geteuid() != 0)
    cr_skip_test("needs root to act as a second uid");
  char root[128], path[256], msg[512];
  snprintf(root, sizeof root, "%s/root", dir);
  cr_assert_eq(mkdir(root, 0755), 0);
  test_daemon d;
  test_daemon_start(&d, (const char *const[]){"--checkpoint-root", root, NULL});
  cr_assert_eq(chmod(d.dir, 0755), 0);
  cr_assert_eq(chmod(d.sock, 0666), 0);

  /* uid 4242 checkpoints below root/4242, which the daemon makes for it */
  snprintf(path, sizeof path, "%s/4242/ck", root);
  cr_assert_eq(ck_child(&d, 4242, 0, path, msg, sizeof msg), SHARDD_OK, "%s", msg);
  struct stat st;
  snprintf(path, sizeof path, "%s/4242", root);
  cr_assert_eq(lstat(path, &st), 0, "root/4242 was not made");
  cr_expect(S_ISDIR(st.st_mode));
  cr_expect_eq(st.st_uid, 4242u, "root/4242 is not uid 4242's");
  cr_expect_eq(st.st_mode & 07777, 0700);
  snprintf(path, sizeof path, "%s/4242/ck/manifest", root);
  cr_assert_eq(access(path, R_OK), 0, "no %s", path);

  /* anywhere else below the root is not its to name: the root itself,
   * its own directory bare, another uid's, a name that merely starts
   * with its uid; restore alike */
  const char *bad[] = {"%s/ck", "%s/4242", "%s/4243/ck", "%s/42421/ck", "%s/0/ck", NULL};
  for (int i = 0; bad[i]; i++) {
    snprintf(path, sizeof path, bad[i], root);
    cr_assert_eq(ck_child(&d, 4242, 0, path, msg, sizeof msg), SHARDD_E_PERMISSION,
                 "checkpoint %s: %s", path, msg);
    cr_expect(strstr(msg, "/4242/"), "names its own directory: %s", msg);
    cr_assert_eq(ck_child(&d, 4242, 1, path, msg, sizeof msg), SHARDD_E_PERMISSION,
                 "restore %s: %s", path, msg);
  }
  snprintf(path, sizeof path, "%s/4243", root);
  cr_assert_eq(access(path, F_OK), -1, "a refused request made %s", path);

  /* a pre-existing root/UID that is not the uid's, or a symlink, is
   * refused, not used */
  snprintf(path, sizeof path, "%s/4243", root);
  cr_assert_eq(mkdir(path, 0777), 0); /* root's, world-writable */
  snprintf(path, sizeof path, "%s/4243/ck", root);
  cr_assert_eq(ck_child(&d, 4243, 0, path, msg, sizeof msg), SHARDD_E_PERMISSION, "%s", msg);
  cr_expect(strstr(msg, "belongs to uid 0"), "%s", msg);
  cr_assert_eq(access(path, F_OK), -1, "it wrote into %s", path);
  char elsewhere[128];
  snprintf(elsewhere, sizeof elsewhere, "%s/elsewhere", dir);
  cr_assert_eq(mkdir(elsewhere, 0700), 0);
  cr_assert_eq(chown(elsewhere, 4244, 4244), 0);
  snprintf(path, sizeof path, "%s/4244", root);
  cr_assert_eq(symlink(elsewhere, path), 0);
  snprintf(path, sizeof path, "%s/4244/ck", root);
  cr_assert_eq(ck_child(&d, 4244, 0, path, msg, sizeof msg), SHARDD_E_PERMISSION, "%s", msg);
  cr_expect(strstr(msg, "symlink"), "%s", msg);
  snprintf(path, sizeof path, "%s/ck", elsewhere);
  cr_assert_eq(access(path, F_OK), -1, "it followed the symlink");

  /* root checkpoints anywhere below the root, uid 4242's job too (as
   * "4242/mine", which lingers) */
  shardd_client_t *c = test_connect(&d, NULL, 0, 1);
  snprintf(path, sizeof path, "%s/byroot", root);
  cr_assert_eq(shardd_checkpoint(c, "4242/mine", path), SHARDD_OK, "%s", shardd_last_error(c));
  snprintf(path, sizeof path, "%s/byroot/manifest", root);
  char *text = test_slurp(path);
  cr_assert(text && strstr(text, "\njob mine 1 4242\n"), "%s", text ? text : "");
  free(text);
  /* and uid 4242 restores its own checkpoint: its job exists, so BUSY,
   * which means the directory passed every check */
  snprintf(path, sizeof path, "%s/4242/ck", root);
  cr_assert_eq(ck_child(&d, 4242, 1, path, msg, sizeof msg), SHARDD_E_BUSY, "%s", msg);
  shardd_close(c);
  cr_assert_eq(test_daemon_stop(&d), 0);
}

/* The unit runs the daemon as user shardd, which cannot chown: there
 * root/UID and what the daemon makes below it are the daemon's, and count
 * as the uid's below its own directory only. The child is that daemon
 * (uid 4300, owning the root) writing for uid 4242. Exit code: 0 as
 * expected, else the step that failed. */
static int as_unprivileged_daemon(const char *root, shardd__job *job) {
  if (setgid(4300) != 0 || setuid(4300) != 0)
    return 10;
  char err[512], home[200], ck[256];
  if (shardd__checkpoint_user_dir(root, 4242, 1, err, sizeof err) != SHARDD_OK)
    return 11;
  snprintf(home, sizeof home, "%s/4242", root);
  struct stat st;
  if (lstat(home, &st) != 0 || st.st_uid != 4300 || (st.st_mode & 07777) != 0700)
    return 12; /* the daemon's own, 0700 */
  snprintf(ck, sizeof ck, "%s/a", home);
  /* not confined, the rules stay: a daemon-made parent is not the uid's */
  if (shardd__checkpoint_write(&reg, job, ck, 4242, err, sizeof err) != SHARDD_E_PERMISSION)
    return 13;
  if (shardd__checkpoint_write_in(&reg, job, ck, 4242, home, err, sizeof err) != SHARDD_OK)
    return 14;
  snprintf(ck, sizeof ck, "%s/a/b", home);
  if (shardd__checkpoint_write_in(&reg, job, ck, 4242, home, err, sizeof err) != SHARDD_OK)
    return 15; /* any depth */
  if (shardd__checkpoint_write_in(&reg, job, ck, 4242, home, err, sizeof err) != SHARDD_OK)
    return 16; /* and again, over the last one */
  /* a root/UID of some other uid is refused */
  snprintf(ck, sizeof ck, "%s/4243", root);
  if (mkdir(ck, 0700) != 0 || chown(ck, 4300, 4300) != 0)
    return 17;
  return 0;
}

Test(checkpoint, an_unprivileged_daemon_keeps_uid_directories_as_its_own, .timeout = 60) {
  if (geteuid() != 0)
    cr_skip_test("needs root to act as the daemon's user");
  char root[128];
  snprintf(root, sizeof root, "%s/root", dir);
  cr_assert_eq(mkdir(root, 0750), 0);
  cr_assert_eq(chown(root, 4300, 4300), 0);
  cr_assert_eq(chmod(dir, 0755), 0);
  shardd__job *job;
  char err[512];
  cr_assert_eq(shardd__job_get(&reg, "mine", 1, 4242, &job, err, sizeof err), SHARDD_OK);
  shardd__buffer *b;
  int created;
  cr_assert_eq(shardd__buffer_register(&reg, job, "x", SHARDD_DTYPE_FP32, 10, &b, &created,
                                       err, sizeof err),
               SHARDD_OK, "%s", err);
  pid_t pid = fork();
  cr_assert(pid >= 0);
  if (pid == 0)
    _exit(as_unprivileged_daemon(root, job));
  int st;
  cr_assert(test_wait_exit(pid, &st));
  cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "step %d failed",
            WIFEXITED(st) ? WEXITSTATUS(st) : -1);
  /* uid 4243's directory made by someone else: refused */
  cr_assert_eq(shardd__checkpoint_user_dir(root, 4243, 1, err, sizeof err),
               SHARDD_E_PERMISSION, "a root/UID of uid 4300, for a daemon that is root");
  cr_expect(strstr(err, "belongs to uid 4300"), "%s", err);
}

/* ---- an operator's checkpoint waits; steps wait for it (issue 19) ------ */

/* An SGD optimizer over buffer buf on raw client r; its id. */
static uint64_t raw_sgd(test_raw *r, uint64_t buf) {
  Shardwire__ParamRef ref = SHARDWIRE__PARAM_REF__INIT, *rp = &ref;
  ref.id = buf;
  Shardwire__ParamGroup g = SHARDWIRE__PARAM_GROUP__INIT, *gp = &g;
  g.refs = &rp;
  g.n_refs = 1;
  Shardwire__HyperParams hp = SHARDWIRE__HYPER_PARAMS__INIT;
  hp.has_lr = 1;
  hp.lr = 0.5;
  Shardwire__RegisterOptimizer ro = SHARDWIRE__REGISTER_OPTIMIZER__INIT;
  ro.name = "sgd";
  ro.kind = SHARDWIRE__OPTIM_KIND__SGD;
  ro.hyper = &hp;
  ro.groups = &gp;
  ro.n_groups = 1;
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  req.body_case = SHARDWIRE__REQUEST__BODY_REGISTER_OPTIMIZER;
  req.register_optimizer = &ro;
  Shardwire__Response *resp = test_raw_expect(r, test_raw_send(r, &req), SHARDD_OK);
  cr_assert_eq(resp->body_case, SHARDWIRE__RESPONSE__BODY_OPTIMIZER);
  uint64_t id = resp->optimizer->id;
  shardwire__response__free_unpacked(resp, NULL);
  return id;
}

static uint64_t send_checkpoint_wait(test_raw *r, const char *job, const char *ck,
                                     double wait_s) {
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Checkpoint cp = SHARDWIRE__CHECKPOINT__INIT;
  cp.dir = (char *)ck;
  cp.job = (char *)job;
  if (wait_s > 0) {
    cp.has_wait_s = 1;
    cp.wait_s = wait_s;
  }
  req.body_case = SHARDWIRE__REQUEST__BODY_CHECKPOINT;
  req.checkpoint = &cp;
  return test_raw_send(r, &req);
}

#define LIVE_NUMEL ((uint64_t)24 << 20) /* fp32: 96 MiB, a write that takes a while */

/* Rank 0's gather is queued (rank 1 has not sent its own): a plain
 * checkpoint is E_BUSY at once, one that may wait does not answer (a Ping
 * behind it on the same connection does). Rank 1's gather ends the
 * collective, the job is quiescent, the checkpoint starts there; both
 * ranks' steps, sent while its 96 MiB are written, are held instead of
 * refused and run after it: each gets step 1, and the checkpoint holds the
 * values from before the step. */
Test(checkpoint, an_operator_checkpoint_waits_for_the_quiescent_point_and_holds_steps,
     .timeout = 60) {
  char ck[128], path[200];
  snprintf(ck, sizeof ck, "%s/quiet", dir);
  test_daemon d;
  test_daemon_start(&d, (const char *const[]){"--backend", "host", "--device-memory",
                                              "2G", "--job-linger", "600", NULL});
  test_raw a, b, e;
  test_raw_open(&d, &a);
  test_raw_open(&d, &b);
  test_raw_open(&d, &e);
  test_raw_hello(&a, "live", 0, 2);
  test_raw_hello(&b, "live", 1, 2);
  test_raw_hello(&e, NULL, 0, 0);
  shardd_buffer_info ia, ib;
  test_raw_register_buffer(&a, "flat", SHARDD_DTYPE_FP32, LIVE_NUMEL, &ia);
  test_raw_register_buffer(&b, "flat", SHARDD_DTYPE_FP32, LIVE_NUMEL, &ib);
  for (uint64_t i = 0; i < ia.shard_numel; i++) {
    ((float *)ia.shard)[i] = 1.0f;
    ((float *)ib.shard)[i] = 2.0f;
  }
  uint64_t opt = raw_sgd(&a, ia.id);
  cr_assert_eq(raw_sgd(&b, ib.id), opt);

  uint64_t g0 = test_raw_send_gather(&a, ia.id);
  test_raw_sync(&a); /* queued, waiting for rank 1 */
  Shardwire__Response *resp =
      test_raw_expect(&e, send_checkpoint_wait(&e, "live", ck, 0), SHARDD_E_BUSY);
  cr_expect(strstr(resp->message, "1 collective(s) in flight"), "%s", resp->message);
  shardwire__response__free_unpacked(resp, NULL);
  uint64_t s_ck = send_checkpoint_wait(&e, "live", ck, 30);
  test_raw_sync(&e); /* the Pong first: the checkpoint waits */
  snprintf(path, sizeof path, "%s/manifest", ck);
  cr_assert_eq(access(path, F_OK), -1, "written while a gather was queued");
  /* status shows the wait next to the gather that holds it up */
  char cmd[256], *out = NULL, *errs = NULL;
  snprintf(cmd, sizeof cmd, "--socket %s status", d.sock);
  cr_assert_eq(test_shardctl(NULL, cmd, &out, &errs), 0, "%s", errs);
  snprintf(path, sizeof path, "checkpoint to %s: waiting ", ck);
  cr_expect(strstr(out, path) && strstr(out, "of 30.0 s for the job's quiescent point"),
            "%s", out);
  free(out);
  free(errs);
  snprintf(cmd, sizeof cmd, "--socket %s --json status", d.sock);
  cr_assert_eq(test_shardctl(NULL, cmd, &out, &errs), 0, "%s", errs);
  tj *j = tj_parse(out);
  cr_assert_not_null(j, "%s", out);
  const tj *pend = tj_need(tj_need(j, "jobs", TJ_ARR)->kids[0], "pending_checkpoints",
                           TJ_ARR);
  cr_assert_eq(pend->n, 1, "%s", out);
  cr_expect_str_eq(tj_need(pend->kids[0], "dir", TJ_STR)->str, ck);
  cr_expect_eq(tj_need(pend->kids[0], "wait_s", TJ_NUM)->num, 30.0);
  tj_free(j);
  free(out);
  free(errs);
  snprintf(path, sizeof path, "%s/manifest", ck);

  uint64_t g1 = test_raw_send_gather(&b, ib.id);
  shardwire__response__free_unpacked(test_raw_expect(&a, g0, SHARDD_OK), NULL);
  shardwire__response__free_unpacked(test_raw_expect(&b, g1, SHARDD_OK), NULL);
  uint64_t t0 = test_raw_send_step(&a, opt), t1 = test_raw_send_step(&b, opt);
  resp = test_raw_expect(&e, s_ck, SHARDD_OK);
  cr_assert_eq(resp->body_case, SHARDWIRE__RESPONSE__BODY_CHECKPOINT);
  cr_expect_str_eq(resp->checkpoint->job, "live");
  shardwire__response__free_unpacked(resp, NULL);
  /* no scatter ran: the step applies a zero reduced gradient; what counts
   * is that it ran, once, after the files */
  resp = test_raw_expect(&a, t0, SHARDD_OK);
  cr_assert_eq(resp->body_case, SHARDWIRE__RESPONSE__BODY_STEP);
  cr_expect_eq(resp->step->step, 1);
  shardwire__response__free_unpacked(resp, NULL);
  resp = test_raw_expect(&b, t1, SHARDD_OK);
  cr_expect_eq(resp->step->step, 1);
  shardwire__response__free_unpacked(resp, NULL);
  cr_expect(test_daemon_log_has(&d, "quiescent after"), "no wait was logged");
  test_raw_close(&a);
  test_raw_close(&b);
  test_raw_close(&e);
  cr_assert_eq(test_daemon_stop(&d), 0);

  /* the checkpoint is the state before the step: 0 steps, rank 1's 2.0s */
  test_daemon_start(&d, (const char *const[]){"--backend", "host", "--device-memory",
                                              "2G", "--restore", ck, NULL});
  cr_assert_eq(job_steps(&d), 0);
  cr_assert_eq(test_daemon_stop(&d), 0);
}

/* Nobody sends rank 1's gather: the wait ends at its bound with what it
 * waited on, and the gather still completes afterwards. */
Test(checkpoint, an_operator_checkpoint_that_times_out_names_what_it_waited_on,
     .timeout = 60) {
  char ck[128];
  snprintf(ck, sizeof ck, "%s/never", dir);
  test_daemon d;
  test_daemon_start(&d, (const char *const[]){"--job-linger", "600", NULL});
  test_raw a, b;
  test_raw_open(&d, &a);
  test_raw_open(&d, &b);
  test_raw_hello(&a, "stuck", 0, 2);
  test_raw_hello(&b, "stuck", 1, 2);
  shardd_buffer_info ia, ib;
  test_raw_register_buffer(&a, "flat", SHARDD_DTYPE_FP32, 1000, &ia);
  test_raw_register_buffer(&b, "flat", SHARDD_DTYPE_FP32, 1000, &ib);
  uint64_t g0 = test_raw_send_gather(&a, ia.id);
  test_raw_sync(&a);
  char cmd[512], *out = NULL, *errs = NULL;
  snprintf(cmd, sizeof cmd, "--socket %s checkpoint stuck %s --timeout 0.3", d.sock, ck);
  double t = test_mono_s();
  int rc = test_shardctl(NULL, cmd, &out, &errs);
  double took = test_mono_s() - t;
  cr_assert_eq(rc, 1, "shardctl %s: %s %s", cmd, out, errs);
  cr_expect(took >= 0.3 && took < 5, "took %.2f s", took);
  cr_expect(strstr(errs, "reached no quiescent point"), "%s", errs);
  cr_expect(strstr(errs, "within 0.3 s"), "%s", errs);
  cr_expect(strstr(errs, "gather of \"flat\" queued"), "%s", errs);
  cr_expect(strstr(errs, "arrived: rank 0, waiting for: rank 1;") ||
                strstr(errs, "arrived: rank 0, waiting for: rank 1 ("),
            "%s", errs);
  cr_expect(access(ck, F_OK) == -1 || access(ck, F_OK) == 0); /* made or not */
  free(out);
  free(errs);
  /* a bad --timeout is a usage error */
  snprintf(cmd, sizeof cmd, "--socket %s checkpoint stuck %s --timeout -1", d.sock, ck);
  cr_expect_eq(test_shardctl(NULL, cmd, NULL, NULL), 2);
  uint64_t g1 = test_raw_send_gather(&b, ib.id);
  shardwire__response__free_unpacked(test_raw_expect(&a, g0, SHARDD_OK), NULL);
  shardwire__response__free_unpacked(test_raw_expect(&b, g1, SHARDD_OK), NULL);
  test_raw_close(&a);
  test_raw_close(&b);
  cr_assert_eq(test_daemon_stop(&d), 0);
}

/* ---- SIGTERM while a step runs (issue 21) --------------------------------
 * Both ranks send a step of a 64 MiB buffer and the daemon is SIGTERMed
 * right behind them, with --checkpoint-on-exit: depending on where the
 * signal lands the step ran (and its reply may or may not have left) or
 * it did not. Whichever: the checkpoint holds every element before the
 * step or every element after it, with the matching count, never a torn
 * mix; and after --restore each rank's retry with expect_step 1 (a
 * scatter first where the step did not run) leaves exactly one step
 * applied. No timing is asserted: every outcome is checked for what it
 * must be. */

#define RUN_NUMEL ((uint64_t)16 << 20)

static uint64_t raw_step_expect(test_raw *r, uint64_t opt, uint64_t expect) {
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Step st = SHARDWIRE__STEP__INIT;
  st.optimizer = opt;
  st.has_expect_step = 1;
  st.expect_step = expect;
  req.body_case = SHARDWIRE__REQUEST__BODY_STEP;
  req.step = &st;
  return test_raw_send(r, &req);
}

/* The next reply, or NULL when the connection ended (closed or reset). */
static Shardwire__Response *raw_next_or_gone(test_raw *r) {
  const uint8_t *payload;
  size_t len;
  int fds[4], nfds = 0;
  char err[256];
  if (shardd__frame_recv(r->fd, &r->rd, &payload, &len, fds, 4, &nfds, err, sizeof err) !=
      SHARDD_OK)
    return NULL;
  for (int i = 0; i < nfds; i++)
    close(fds[i]);
  return shardwire__response__unpack(NULL, len, payload);
}

static void fill_big(const shardd_buffer_info *b, float shard, float grad) {
  for (uint64_t i = 0; i < b->shard_numel; i++)
    ((float *)b->shard)[i] = shard;
  for (uint64_t j = 0; j < b->padded_numel; j++)
    ((float *)b->grad)[j] = grad;
}

/* every element of the shard is v: -> the first that is not, or -1 */
static int64_t first_not(const shardd_buffer_info *b, float v) {
  for (uint64_t i = 0; i < b->shard_numel; i++)
    if (((const float *)b->shard)[i] != v)
      return (int64_t)i;
  return -1;
}

Test(checkpoint, sigterm_while_a_step_runs_checkpoints_it_whole_or_not_at_all,
     .timeout = 60) {
  char ck[128];
  snprintf(ck, sizeof ck, "%s/running", dir);
  test_daemon d;
  test_daemon_start(&d, (const char *const[]){"--backend", "host", "--device-memory", "2G",
                                              "--checkpoint-on-exit", ck, NULL});
  test_raw a, b;
  test_raw_open(&d, &a);
  test_raw_open(&d, &b);
  test_raw_hello(&a, "run", 0, 2);
  test_raw_hello(&b, "run", 1, 2);
  shardd_buffer_info ia, ib;
  test_raw_register_buffer(&a, "flat", SHARDD_DTYPE_FP32, RUN_NUMEL, &ia);
  test_raw_register_buffer(&b, "flat", SHARDD_DTYPE_FP32, RUN_NUMEL, &ib);
  /* mean gradient 2: SGD lr 0.5 takes 1 off every element */
  fill_big(&ia, 1.0f, 1.0f);
  fill_big(&ib, 2.0f, 3.0f);
  uint64_t opt = raw_sgd(&a, ia.id);
  cr_assert_eq(raw_sgd(&b, ib.id), opt);
  uint64_t s0 = test_raw_send_scatter(&a, ia.id, SHARDD_REDUCE_MEAN);
  uint64_t s1 = test_raw_send_scatter(&b, ib.id, SHARDD_REDUCE_MEAN);
  shardwire__response__free_unpacked(test_raw_expect(&a, s0, SHARDD_OK), NULL);
  shardwire__response__free_unpacked(test_raw_expect(&b, s1, SHARDD_OK), NULL);
  uint64_t t[2] = {raw_step_expect(&a, opt, 1), raw_step_expect(&b, opt, 1)};
  cr_assert_eq(test_daemon_stop(&d), 0); /* SIGTERM right behind the steps */
  test_raw *rr[2] = {&a, &b};
  int replied = 0;
  for (int k = 0; k < 2; k++) {
    Shardwire__Response *resp = raw_next_or_gone(rr[k]);
    if (resp && resp->seq == t[k] && resp->code == SHARDWIRE__STATUS_CODE__OK)
      replied++;
    if (resp)
      shardwire__response__free_unpacked(resp, NULL);
    test_raw_close(rr[k]);
  }

  test_daemon_start(&d, (const char *const[]){"--backend", "host", "--device-memory", "2G",
                                              "--restore", ck, NULL});
  uint64_t steps = job_steps(&d);
  cr_log_info("SIGTERM behind the steps: %d rank(s) had the reply; the checkpoint holds "
              "%" PRIu64 " step(s)", replied, steps);
  cr_assert(steps <= 1, "%" PRIu64 " steps from one", steps);
  cr_assert(replied == 0 || steps == 1, "a rank was told the step ran; the checkpoint says not");
  test_raw_open(&d, &a);
  test_raw_open(&d, &b);
  test_raw_hello(&a, "run", 0, 2);
  test_raw_hello(&b, "run", 1, 2);
  test_raw_register_buffer(&a, "flat", SHARDD_DTYPE_FP32, RUN_NUMEL, &ia);
  test_raw_register_buffer(&b, "flat", SHARDD_DTYPE_FP32, RUN_NUMEL, &ib);
  cr_assert(!ia.created && !ib.created);
  cr_assert_eq(raw_sgd(&a, ia.id), raw_sgd(&b, ib.id));
  int64_t i0 = first_not(&ia, steps ? 0.0f : 1.0f), i1 = first_not(&ib, steps ? 1.0f : 2.0f);
  cr_assert_eq(i0, -1, "rank 0's shard is torn at %" PRId64 " (count %" PRIu64 ")", i0, steps);
  cr_assert_eq(i1, -1, "rank 1's shard is torn at %" PRId64 " (count %" PRIu64 ")", i1, steps);
  if (steps == 0) { /* the gradients are the trainer's to send again */
    fill_big(&ia, 1.0f, 1.0f);
    fill_big(&ib, 2.0f, 3.0f);
    s0 = test_raw_send_scatter(&a, ia.id, SHARDD_REDUCE_MEAN);
    s1 = test_raw_send_scatter(&b, ib.id, SHARDD_REDUCE_MEAN);
    shardwire__response__free_unpacked(test_raw_expect(&a, s0, SHARDD_OK), NULL);
    shardwire__response__free_unpacked(test_raw_expect(&b, s1, SHARDD_OK), NULL);
  }
  t[0] = raw_step_expect(&a, opt, 1);
  t[1] = raw_step_expect(&b, opt, 1);
  for (int k = 0; k < 2; k++) {
    Shardwire__Response *resp = test_raw_expect(rr[k], t[k], SHARDD_OK);
    cr_assert_eq(resp->body_case, SHARDWIRE__RESPONSE__BODY_STEP);
    cr_assert_eq(resp->step->step, 1);
    cr_assert_eq(resp->step->has_applied && !resp->step->applied, steps == 1,
                 "rank %d: the retry %s", k, steps == 1 ? "ran again" : "was skipped");
    shardwire__response__free_unpacked(resp, NULL);
  }
  cr_assert_eq(first_not(&ia, 0.0f), -1, "rank 0: not exactly one step");
  cr_assert_eq(first_not(&ib, 1.0f), -1, "rank 1: not exactly one step");
  cr_assert_eq(job_steps(&d), 1);
  test_raw_close(&a);
  test_raw_close(&b);
  cr_assert_eq(test_daemon_stop(&d), 0);
}

/* ---- collective checkpoints: replies by what the daemon issued --------- */

static uint64_t send_collective_checkpoint(test_raw *r, const char *ck) {
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Checkpoint cp = SHARDWIRE__CHECKPOINT__INIT;
  cp.dir = (char *)ck;
  cp.has_collective = 1;
  cp.collective = 1;
  req.body_case = SHARDWIRE__REQUEST__BODY_CHECKPOINT;
  req.checkpoint = &cp;
  return test_raw_send(r, &req);
}

/* A gather sent with a seq of the test's choosing (libshardd never reuses
 * one; a hostile client may). */
static void send_gather_as(test_raw *r, uint64_t buf, uint64_t seq) {
  Shardwire__Request req = SHARDWIRE__REQUEST__INIT;
  Shardwire__Gather g = SHARDWIRE__GATHER__INIT;
  g.buffer = buf;
  req.seq = seq;
  req.body_case = SHARDWIRE__REQUEST__BODY_GATHER;
  req.gather = &g;
  test_raw_send(r, &req);
}

/* Hello as rank of job until the daemon takes it (the job of that name
 * before it may still be going away); fails the test after the hang guard. */
static void hello_when_free(const test_daemon *d, test_raw *r, const char *job,
                            uint32_t rank, uint32_t world) {
  for (double end = test_mono_s() + TEST_HANG_S;;) {
    test_raw_open(d, r);
    uint64_t seq = test_raw_send_hello(r, SHARDD_PROTOCOL_VERSION, job, rank, world);
    Shardwire__Response *resp = test_raw_recv(r);
    cr_assert_not_null(resp, "the daemon closed the connection at Hello");
    cr_assert_eq(resp->seq, seq);
    int ok = resp->code == SHARDWIRE__STATUS_CODE__OK;
    shardwire__response__free_unpacked(resp, NULL);
    if (ok)
      return;
    test_raw_close(r);
    cr_assert(test_mono_s() < end, "job \"%s\" was never released", job);
    test_sleep_ms(10);
  }
}

/* Rank 0 asks for a collective checkpoint, then sends a gather with that
 * request's seq. The gather is refused (E_PROTOCOL, naming the seq): it
 * used to be taken, and its end, routed by the seq alone, stood in for the
 * checkpoint barrier's, leaving a half-arrived checkpoint group that
 * outlived the job (--job-linger 0: released when both ranks left). The
 * next job of that name, world 4, found that group by the freed job's
 * address and wrote its ranks past the group's [2] (a heap overflow, or
 * under ASan the freed job read at exit). Here the new job's collective
 * checkpoint is written and the daemon exits clean. */
Test(checkpoint, a_gather_reusing_a_collective_checkpoints_seq_strands_nothing,
     .timeout = 90) {
  char ck[128], ck2[128], path[200];
  snprintf(ck, sizeof ck, "%s/first", dir);
  snprintf(ck2, sizeof ck2, "%s/second", dir);
  test_daemon d;
  test_daemon_start(&d, (const char *const[]){"--job-linger", "0", NULL});
  test_raw a, b;
  test_raw_open(&d, &a);
  test_raw_open(&d, &b);
  test_raw_hello(&a, "reuse", 0, 2);
  test_raw_hello(&b, "reuse", 1, 2);
  shardd_buffer_info ia, ib;
  test_raw_register_buffer(&a, "flat", SHARDD_DTYPE_FP32, 1000, &ia);
  test_raw_register_buffer(&b, "flat", SHARDD_DTYPE_FP32, 1000, &ib);

  uint64_t s = send_collective_checkpoint(&a, ck); /* waits for rank 1 */
  send_gather_as(&a, ia.id, s);
  Shardwire__Response *early;
  test_raw_sync_keep(&a, &early);
  int refused = early != NULL;
  cr_expect(refused, "a gather reusing the seq of the rank's pending collective "
            "checkpoint was taken");
  if (early) {
    cr_expect_eq(early->seq, s);
    cr_expect_eq((int)early->code, (int)SHARDD_E_PROTOCOL, "%s: %s",
                 shardd_err_name((shardd_err)early->code),
                 early->message ? early->message : "");
    char want[64];
    snprintf(want, sizeof want, "seq %" PRIu64, s);
    cr_expect(early->message && strstr(early->message, want) &&
                  strstr(early->message, "collective checkpoint"),
              "%s", early->message ? early->message : "");
    shardwire__response__free_unpacked(early, NULL);
  }
  /* rank 1's gather pairs with rank 0's: the refused one's replacement, or
   * (before) the one taken under the checkpoint's seq */
  uint64_t gb = test_raw_send_gather(&b, ib.id);
  if (refused) {
    uint64_t ga = test_raw_send_gather(&a, ia.id);
    shardwire__response__free_unpacked(test_raw_expect(&a, ga, SHARDD_OK), NULL);
  }
  shardwire__response__free_unpacked(test_raw_expect(&b, gb, SHARDD_OK), NULL);
  test_raw_close(&a); /* its checkpoint never had rank 1's request */
  test_raw_close(&b);

  /* the next job of that name, another world: its ranks' checkpoint */
  test_raw r[4];
  hello_when_free(&d, &r[0], "reuse", 0, 4);
  for (uint32_t k = 1; k < 4; k++) {
    test_raw_open(&d, &r[k]);
    test_raw_hello(&r[k], "reuse", k, 4);
  }
  uint64_t seqs[4];
  for (uint32_t k = 0; k < 4; k++) {
    shardd_buffer_info bi;
    test_raw_register_buffer(&r[k], "flat", SHARDD_DTYPE_FP32, 1000, &bi);
    seqs[k] = send_collective_checkpoint(&r[k], ck2);
  }
  for (uint32_t k = 0; k < 4; k++) {
    Shardwire__Response *resp = test_raw_recv(&r[k]);
    cr_assert_not_null(resp, "rank %u's connection closed (the daemon died?)", k);
    cr_expect_eq(resp->seq, seqs[k]);
    cr_expect_eq((int)resp->code, (int)SHARDD_OK, "rank %u: %s (%s)", k,
                 shardd_err_name((shardd_err)resp->code),
                 resp->message ? resp->message : "");
    shardwire__response__free_unpacked(resp, NULL);
  }
  snprintf(path, sizeof path, "%s/manifest", ck2);
  cr_expect_eq(access(path, R_OK), 0, "no %s", path);
  for (uint32_t k = 0; k < 4; k++)
    test_raw_close(&r[k]);
  test_daemon_finish(&d);
}

/* ---- operators' checkpoints waiting: bounded -------------------------- */

/* the daemon's bounds (README, security) */
#define PEND_PER_SESSION 16
#define PEND_PER_UID 64

/* A checkpoint dir of len bytes: dir/ then 'a's. */
static char *long_dir(size_t len) {
  char *p = malloc(len + 1);
  cr_assert_not_null(p);
  int n = snprintf(p, len + 1, "%s/", dir);
  memset(p + n, 'a', len - (size_t)n);
  p[len] = '\0';
  return p;
}

/* In a child as uid: job "busy" whose rank 0 waits in a gather, then
 * sessions asking for checkpoints of it that may wait 60 s. A dir longer
 * than PATH_MAX is refused at once; 16 per session wait and the 17th is
 * refused; four sessions' 64 wait and a fifth session's first is refused
 * naming the bound per uid. Then it keeps everything open until the
 * parent writes to go_fd. Exit code 0, else the check that failed (its
 * reply in msg_fd). */
static int pend_as(const test_daemon *d, uid_t uid, int msg_fd, int go_fd) {
  if (setgid(uid) != 0 || setuid(uid) != 0)
    return 100;
  test_raw job, s[5];
  test_raw_open(d, &job);
  test_raw_hello(&job, "busy", 0, 2);
  shardd_buffer_info bi;
  test_raw_register_buffer(&job, "flat", SHARDD_DTYPE_FP32, 1000, &bi);
  test_raw_send_gather(&job, bi.id);
  test_raw_sync(&job);
  char *path = long_dir(4000), *huge = long_dir((size_t)1 << 20);
  Shardwire__Response *early;
  int code = 0;
#define PEND_FAIL(n, resp)                                                     \
  do {                                                                         \
    const char *m_ = (resp) && (resp)->message ? (resp)->message : "(no reply)"; \
    if (write(msg_fd, m_, strlen(m_)) < 0) {                                   \
    }                                                                          \
    code = (n);                                                                \
    goto out;                                                                  \
  } while (0)
  for (int k = 0; k < 5; k++) {
    test_raw_open(d, &s[k]);
    test_raw_hello(&s[k], NULL, 0, 0);
  }
  /* a path past PATH_MAX is never stored */
  uint64_t seq = send_checkpoint_wait(&s[0], "busy", huge, 60);
  test_raw_sync_keep(&s[0], &early);
  if (early == NULL || early->seq != seq ||
      early->code != SHARDWIRE__STATUS_CODE__E_RANGE ||
      !strstr(early->message, "PATH_MAX"))
    PEND_FAIL(1, early);
  shardwire__response__free_unpacked(early, NULL);
  for (int k = 0; k < 4; k++) {
    for (int i = 0; i < PEND_PER_SESSION; i++)
      send_checkpoint_wait(&s[k], "busy", path, 60);
    test_raw_sync_keep(&s[k], &early);
    if (early)
      PEND_FAIL(2, early); /* all of them wait */
  }
  seq = send_checkpoint_wait(&s[0], "busy", path, 60);
  test_raw_sync_keep(&s[0], &early);
  if (early == NULL || early->seq != seq ||
      early->code != SHARDWIRE__STATUS_CODE__E_LIMIT ||
      !strstr(early->message, "16") || !strstr(early->message, "per session"))
    PEND_FAIL(3, early);
  shardwire__response__free_unpacked(early, NULL);
  seq = send_checkpoint_wait(&s[4], "busy", path, 60);
  test_raw_sync_keep(&s[4], &early);
  if (early == NULL || early->seq != seq ||
      early->code != SHARDWIRE__STATUS_CODE__E_LIMIT ||
      !strstr(early->message, "64") || !strstr(early->message, "per uid"))
    PEND_FAIL(4, early);
  shardwire__response__free_unpacked(early, NULL);
#undef PEND_FAIL
  if (write(msg_fd, "ok", 2) < 0)
    code = 101;
  char go;
  if (read(go_fd, &go, 1) != 1)
    code = 102;
out:
  free(path);
  free(huge);
  return code;
}

/* One uid's operator checkpoints waiting for a quiescent point used to pile
 * up without a bound, each holding its path (a connection sending 1 MiB
 * paths OOM-killed the daemon in 24 s). Now a path is bounded by PATH_MAX
 * before it is stored, and the waits by 16 per session and 64 per uid
 * other than root (E_LIMIT naming the bound); meanwhile another client's
 * Ping is answered and root's own checkpoint of a busy job still waits. */
Test(checkpoint, waiting_operator_checkpoints_are_bounded_per_session_and_uid,
     .timeout = 120) {
  if (geteuid() != 0)
    cr_skip_test("needs root to act as a second uid");
  test_daemon d;
  test_daemon_start(&d, (const char *const[]){"--job-linger", "600", NULL});
  cr_assert_eq(chmod(d.dir, 0755), 0);
  cr_assert_eq(chmod(d.sock, 0666), 0);
  int msg[2], go[2];
  cr_assert_eq(pipe(msg), 0);
  cr_assert_eq(pipe(go), 0);
  pid_t pid = fork();
  cr_assert(pid >= 0);
  if (pid == 0) {
    close(msg[0]);
    close(go[1]);
    _exit(pend_as(&d, 4242, msg[1], go[0]));
  }
  close(msg[1]);
  close(go[0]);
  char text[512];
  ssize_t n = read(msg[0], text, sizeof text - 1);
  text[n > 0 ? n : 0] = '\0';
  if (strcmp(text, "ok") != 0) { /* it has exited */
    int st;
    cr_assert(test_wait_exit(pid, &st), "the uid 4242 child did not finish");
    cr_assert_fail("the uid 4242 child: step %d: %s",
                   WIFEXITED(st) ? WEXITSTATUS(st) : -1, text);
  }

  /* another client is served, and root's own job may still wait */
  test_raw p, rk;
  test_raw_open(&d, &p);
  test_raw_hello(&p, NULL, 0, 0);
  test_raw_sync(&p);
  test_raw_open(&d, &rk);
  test_raw_hello(&rk, "rootjob", 0, 2);
  shardd_buffer_info bi;
  test_raw_register_buffer(&rk, "flat", SHARDD_DTYPE_FP32, 1000, &bi);
  test_raw_send_gather(&rk, bi.id);
  test_raw_sync(&rk);
  char ck[128];
  snprintf(ck, sizeof ck, "%s/rootck", dir);
  send_checkpoint_wait(&p, "rootjob", ck, 60);
  Shardwire__Response *early;
  test_raw_sync_keep(&p, &early);
  cr_expect_null(early, "root's checkpoint was refused: %s",
                 early && early->message ? early->message : "");
  if (early)
    shardwire__response__free_unpacked(early, NULL);

  cr_assert_eq(write(go[1], "g", 1), 1);
  close(go[1]);
  close(msg[0]);
  int st;
  cr_assert(test_wait_exit(pid, &st), "the uid 4242 child did not finish");
  cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "the uid 4242 child: step %d, %s",
            WIFEXITED(st) ? WEXITSTATUS(st) : -1, text);
  test_raw_close(&p);
  test_raw_close(&rk);
  test_daemon_finish(&d);
}
