/* test_checkpoint_security.c — checkpoints and other users: manifests
 * that name another owner, files another user wrote, and
 * --checkpoint-root per uid. */
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

/* ---- security ----------------------------------------------------------- */

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

/* Every byte of the manifest is sealed; an edited step count (a
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

/* ---- --checkpoint-root per uid ------------------------------------------ */

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
  test_daemon_open_to_all(&d);

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
