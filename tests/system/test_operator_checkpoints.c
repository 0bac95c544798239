/* test_operator_checkpoints.c — checkpoints an operator or a job asks
 * of a real daemon: of a live job (restored, it continues training
 * exactly), waiting for a step and steps waiting for it, how many may
 * wait, and collective checkpoints' replies by what the daemon issued. */
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

/* ---- an operator's checkpoint of a live job ---------------------------- */

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

/* ---- an operator's checkpoint waits; steps wait for it ------------------ */

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
      test_raw_expect(&e, test_raw_send_checkpoint_wait(&e, "live", ck, 0), SHARDD_E_BUSY);
  cr_expect(strstr(resp->message, "1 collective(s) in flight"), "%s", resp->message);
  shardwire__response__free_unpacked(resp, NULL);
  uint64_t s_ck = test_raw_send_checkpoint_wait(&e, "live", ck, 30);
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

/* ---- operators' checkpoints waiting: bounded -------------------------- */

/* the daemon's bounds (docs/security.md) */
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
  uint64_t seq = test_raw_send_checkpoint_wait(&s[0], "busy", huge, 60);
  test_raw_sync_keep(&s[0], &early);
  if (early == NULL || early->seq != seq ||
      early->code != SHARDWIRE__STATUS_CODE__E_RANGE ||
      !strstr(early->message, "PATH_MAX"))
    PEND_FAIL(1, early);
  shardwire__response__free_unpacked(early, NULL);
  for (int k = 0; k < 4; k++) {
    for (int i = 0; i < PEND_PER_SESSION; i++)
      test_raw_send_checkpoint_wait(&s[k], "busy", path, 60);
    test_raw_sync_keep(&s[k], &early);
    if (early)
      PEND_FAIL(2, early); /* all of them wait */
  }
  seq = test_raw_send_checkpoint_wait(&s[0], "busy", path, 60);
  test_raw_sync_keep(&s[0], &early);
  if (early == NULL || early->seq != seq ||
      early->code != SHARDWIRE__STATUS_CODE__E_LIMIT ||
      !strstr(early->message, "16") || !strstr(early->message, "per session"))
    PEND_FAIL(3, early);
  shardwire__response__free_unpacked(early, NULL);
  seq = test_raw_send_checkpoint_wait(&s[4], "busy", path, 60);
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
  test_daemon_open_to_all(&d);
  int msg[2], go[2];
  pid_t pid = test_fork_with_pipes(msg, go);
  if (pid == 0)
    _exit(pend_as(&d, 4242, msg[1], go[0]));
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
  test_raw_send_checkpoint_wait(&p, "rootjob", ck, 60);
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
