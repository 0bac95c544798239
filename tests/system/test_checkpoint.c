/* test_checkpoint.c — the checkpoint format, in process: a round trip
 * keeps every byte; corrupt, truncated, swapped or foreign data files and
 * manifests that are not what shardd wrote are refused naming what is
 * wrong; generations and frozen views come back; a hostile checkpoint
 * directory; the sizes a checkpoint states. */
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
#include "checkpoint_fixture.h"
#include "manifest.h"
#include "optcodec.h"
#include "proto/shardd.pb-c.h"
#include "registry.h"
#include "validate.h"

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

/* ---- generations and frozen views ---------------------------------------- */

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

/* A linked data file: the attacker's own directory, its own manifest,
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

/* A client checkpoints its own job only into a directory of its
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
