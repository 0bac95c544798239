/* main.c — shardd's start (backend choice, systemd socket activation and
 * readiness, --restore), the loop's run, and --checkpoint-on-exit and
 * teardown after it. The command line is cli.c. */
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>
#include <uv.h>

#include "backend.h"
#include "checkpoint.h"
#include "cli.h"
#include "fdstore.h"
#include "log.h"
#include "manifest.h"
#include "strbuf.h"
#include "sdnotify.h"
#include "server.h"

/* DIR/JOB with the job name made safe as one path component. */
static char *job_dir(const char *dir, const char *job) {
  shardd__sb sb;
  shardd__sb_init(&sb);
  shardd__sb_printf(&sb, "%s/", dir);
  for (const unsigned char *p = (const unsigned char *)job; *p; p++) {
    if (*p == '/' || *p == '%' || *p < 0x20 || *p >= 0x7f || (p == (const unsigned char *)job && *p == '.'))
      shardd__sb_printf(&sb, "%%%02x", *p);
    else
      shardd__sb_printf(&sb, "%c", *p);
  }
  return shardd__sb_take(&sb);
}

typedef struct {
  shardd__job **jobs;
  size_t n, cap;
  int failed; /* out of memory collecting them */
} job_list;

static void collect_job(shardd__job *job, void *arg) {
  job_list *l = arg;
  if (l->n == l->cap) {
    size_t ncap = l->cap ? 2 * l->cap : 16;
    shardd__job **p = realloc(l->jobs, ncap * sizeof *p);
    if (p == NULL) {
      l->failed = 1;
      return;
    }
    l->jobs = p;
    l->cap = ncap;
  }
  l->jobs[l->n++] = job;
}

/* DIR/JOB for root's jobs, DIR/UID%2fJOB for another uid's ("UID/JOB",
 * the name root gives it, as one component): job names are per uid, so
 * two users' jobs of one name need two directories. */
static char *exit_dir(const char *dir, const shardd__job *job) {
  char qualified[300];
  snprintf(qualified, sizeof qualified, "%u/%s", (unsigned)job->uid, job->name);
  return job_dir(dir, job->uid == 0 ? job->name : qualified);
}

/* An exit checkpoint in dir that its job stepped past after the last
 * restore from it (shardd__checkpoint_supersede), no newer one written
 * since (kill -9, a crash, a stop cut short, the job gone before the
 * stop): 1, logged
 * naming the job, its step and how to restore it anyway. A marker naming
 * another seal is stale (a newer checkpoint replaced the one it names)
 * and is removed. */
static int superseded(const char *dir) {
  char err[1024], path[4096];
  shardd__cksuperseded m;
  shardd_err rc = shardd__checkpoint_superseded(dir, &m, err, sizeof err);
  if (rc == SHARDD_E_NOT_FOUND)
    return 0;
  snprintf(path, sizeof path, "%s/%s", dir, SHARDD__SUPERSEDED_FILE);
  if (rc != SHARDD_OK) {
    shardd__log(0, "--restore: %s; %s not restored (remove %s to restore it)",
                err, dir, path);
    return 1;
  }
  char part[4096];
  uint32_t seal;
  snprintf(part, sizeof part, "%s/%s", dir, m.part);
  if (shardd__checkpoint_seal(part, &seal, err, sizeof err) != SHARDD_OK)
    return 0; /* the restore refuses it, naming the file */
  if (seal != m.seal) {
    shardd__log(2, "--restore: %s names the checkpoint sealed %08" PRIx32
                ", replaced since (now sealed %08" PRIx32 "); removed", path,
                m.seal, seal);
    unlink(path);
    return 0;
  }
  shardd__log(0, "--restore: job \"%s\" in %s not restored: this exit "
              "checkpoint holds step %" PRIu64 ", and the job had stepped past "
              "it since it was restored from it, but no newer exit checkpoint "
              "replaced it (the daemon was killed or crashed, its stop was cut "
              "short by SIGKILL, or the job ended or was released before the "
              "stop); restoring it would roll the job back unannounced. To "
              "resume from step %" PRIu64 " anyway: shardctl restore %s, or "
              "remove %s and restart",
              m.job, dir, m.step, m.step, dir, path);
  return 1;
}

/* The job line of dir/manifest: its name (decoded) and owner; 0 when
 * there is none to read (the restore says why, if it is tried). */
static int manifest_job(const char *dir, char *name, size_t len, uint32_t *uid) {
  char path[4096], line[2048], tok[1024];
  unsigned world, u;
  snprintf(path, sizeof path, "%s/%s", dir, SHARDD__MANIFEST_FILE);
  FILE *f = fopen(path, "r");
  int ok = 0;
  if (f == NULL)
    return 0;
  while (!ok && fgets(line, sizeof line, f))
    ok = sscanf(line, "job %1023s %u %u", tok, &world, &u) == 3 &&
         shardd__manifest_dec_name(tok) && strlen(tok) < len;
  fclose(f);
  if (ok) {
    memcpy(name, tok, strlen(tok) + 1);
    *uid = u;
  }
  return ok;
}

/* With the fd store: a job it held at start (resumed from it, or torn)
 * is not restored from its exit checkpoint, which is at best as new; a
 * torn job's refusals name that checkpoint. 1 when held (logged). */
static int held_by_fd_store(shardd__server *srv, const char *dir) {
  char name[256];
  uint32_t uid;
  if (srv->d.fdstore == NULL || !manifest_job(dir, name, sizeof name, &uid) ||
      !shardd__fdstore_held(srv->d.fdstore, uid, name))
    return 0;
  char msg[8];
  if (shardd__fdstore_torn(srv->d.fdstore, uid, name, msg, sizeof msg)) {
    shardd__fdstore_set_hint(srv->d.fdstore, uid, name, dir);
    shardd__log(1, "--restore: job \"%s\" in %s not restored: the fd store "
                "held it torn; its trainers are refused, naming this "
                "checkpoint, until an operator releases or restores it",
                name, dir);
  } else {
    shardd__log(2, "--restore: job \"%s\" in %s not restored: the fd store "
                "held it (resumed from there, as logged above; the fd store "
                "takes precedence over an exit checkpoint)", name, dir);
    /* its first step supersedes this checkpoint as it would after a
     * restore from it: a later start without the store (a reboot) must
     * not roll the job back to it in silence */
    shardd__job *job = shardd__job_find(&srv->d.reg, uid, name);
    char err[1024] = "";
    uint32_t seal;
    if (job && (shardd__checkpoint_seal(dir, &seal, err, sizeof err) !=
                    SHARDD_OK ||
                shardd__jobs_resumed(&srv->d.jobs, job, dir, ".", seal) !=
                    SHARDD_OK))
      shardd__log(0, "job \"%s\": its exit checkpoint in %s cannot be "
                  "marked superseded at its first step (%s)", name, dir,
                  err[0] ? err : "out of memory");
  }
  return 1;
}

/* own_exit: dir is an exit checkpoint (--restore names the directory
 * --checkpoint-on-exit writes): skipped when superseded, and marked so at
 * the job's first step. */
static int restore_one(shardd__server *srv, const char *dir, int own_exit) {
  char err[1024];
  shardd__job *job;
  if (own_exit && held_by_fd_store(srv, dir))
    return 0;
  if (own_exit && superseded(dir))
    return -1;
  if (shardd__jobs_restore_now(&srv->d.jobs, dir, -1, 0, &job, err, sizeof err) !=
      SHARDD_OK) {
    shardd__log(0, "restore refused: %s", err);
    return -1;
  }
  if (shardd__jobs_unclaimed(&srv->d.jobs, job, shardd__server_now(srv), 0) !=
      SHARDD_OK)
    return -1; /* released again, and logged */
  uint64_t step = shardd__jobs_step(job);
  shardd__log(2, "job \"%s\" restored from %s at step %" PRIu64, job->name, dir,
              step);
  if (!own_exit)
    return 0;
  /* the manifest restored: dir's own, or this node's exit part */
  char part[32], path[4096];
  uint32_t seal;
  snprintf(path, sizeof path, "%s/manifest", dir);
  if (access(path, F_OK) == 0)
    snprintf(part, sizeof part, ".");
  else
    snprintf(part, sizeof part, "node-%" PRIu32, job->node_rank);
  snprintf(path, sizeof path, "%s/%s", dir, part);
  if (shardd__checkpoint_seal(path, &seal, err, sizeof err) != SHARDD_OK ||
      shardd__jobs_resumed(&srv->d.jobs, job, dir, part, seal) != SHARDD_OK)
    shardd__log(0, "job \"%s\": its exit checkpoint in %s cannot be marked "
                "superseded at its first step (%s); a restart after a crash "
                "would roll it back to step %" PRIu64, job->name, dir,
                err[0] ? err : "out of memory", step);
  return 0;
}

/* Whether dir holds this daemon's part of a multi-node job (node-N, N
 * its spec's node) without a job manifest: an exit part, which a daemon
 * restarted with the job's spec restores to rejoin the live nodes. */
static int has_exit_part(const shardd__server *srv, const char *dir) {
  char path[4096];
  struct stat st;
  for (size_t i = 0; i < srv->d.jobs.nspecs; i++) {
    snprintf(path, sizeof path, "%s/node-%" PRIu32 "/manifest", dir,
             srv->d.jobs.specs[i].node_rank);
    if (srv->d.jobs.specs[i].nodes > 1 && stat(path, &st) == 0)
      return 1;
  }
  return 0;
}

/* DIR itself, or each DIR/JOB that holds a manifest (or this node's exit
 * part of a multi-node job). Returns how many jobs could not be restored:
 * each is logged and skipped, because one damaged job must not keep the
 * others from serving (under Restart=on-failure an exit would be a restart
 * loop). A DIR that does not exist yet (the first start of a unit that
 * restores its own exit checkpoint) restores nothing. own_exit: DIR is
 * the --checkpoint-on-exit directory (see restore_one). */
static int restore_all(shardd__server *srv, const char *dir, int own_exit) {
  char path[4096];
  struct stat st;
  snprintf(path, sizeof path, "%s/manifest", dir);
  if (stat(path, &st) == 0 || has_exit_part(srv, dir))
    return restore_one(srv, dir, own_exit) != 0;
  DIR *d = opendir(dir);
  if (d == NULL) {
    if (errno == ENOENT) {
      shardd__log(1, "--restore %s: no such directory; nothing restored", dir);
      return 0;
    }
    shardd__log(0, "--restore %s: %s", dir, strerror(errno));
    return 1;
  }
  int rc = 0, n = 0;
  for (struct dirent *e; (e = readdir(d)) != NULL;) {
    if (e->d_name[0] == '.')
      continue;
    snprintf(path, sizeof path, "%s/%s/manifest", dir, e->d_name);
    char sub[4096];
    snprintf(sub, sizeof sub, "%s/%s", dir, e->d_name);
    if (stat(path, &st) != 0 && !has_exit_part(srv, sub)) {
      /* A job whose checkpoint vanished must not vanish without a word. */
      snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
      if (stat(path, &st) == 0 && S_ISDIR(st.st_mode))
        shardd__log(1, "--restore: %s has no manifest (an incomplete "
                    "checkpoint, or not one); skipped", path);
      continue;
    }
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    n++;
    if (restore_one(srv, path, own_exit) != 0)
      rc++;
  }
  closedir(d);
  if (n == 0)
    shardd__log(1, "--restore %s: no checkpoint found", dir);
  return rc;
}

/* Whether --restore a names the directory --checkpoint-on-exit b writes
 * (b may be NULL): what it restores are the daemon's own exit checkpoints,
 * which a step of their job supersedes. Any other --restore, like
 * `shardctl restore`, restores an operator's checkpoint, on purpose, as
 * often as asked. */
static int same_dir(const char *a, const char *b) {
  struct stat sa, sb;
  if (b == NULL)
    return 0;
  if (stat(a, &sa) == 0 && stat(b, &sb) == 0)
    return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
  return strcmp(a, b) == 0;
}

/* Process-wide settings, before the loop or its thread pool exists. */
static void prepare_process(void) {
  /* A client that dies while its reply is being written must cost the
   * daemon an EPIPE on that session, not its life: libuv writes with
   * write(2), which raises SIGPIPE. */
  signal(SIGPIPE, SIG_IGN);

  /* Every rank block is a memfd the daemon keeps open: take the fd limit
   * the administrator allows instead of the shell's default soft limit. */
  struct rlimit nofile;
  if (getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur < nofile.rlim_max) {
    nofile.rlim_cur = nofile.rlim_max;
    setrlimit(RLIMIT_NOFILE, &nofile);
  }

  /* Work items are whole shard copies and optimizer updates: let every
   * core take one. Must be set before the pool's first use. */
  if (getenv("UV_THREADPOOL_SIZE") == NULL) {
    char n[16];
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    snprintf(n, sizeof n, "%ld", cpus < 4 ? 4 : cpus > 128 ? 128 : cpus);
    setenv("UV_THREADPOOL_SIZE", n, 1);
  }
}

/* The --backend the command line asked for ("auto": cuda when a GPU is
 * found). *out is the caller's, destroyed through its ops; on failure the
 * reason is on stderr. */
static shardd_err create_backend(const shardd__cli *cli, shardd__backend **out) {
  char err[512];
  shardd_err rc;
  *out = NULL;
  int want_cuda = strcmp(cli->backend, "cuda") == 0 ||
                  (strcmp(cli->backend, "auto") == 0 && shardd__cuda_device_count() > 0);
  if (want_cuda) {
    rc = shardd__backend_cuda_create(cli->devices, out, err, sizeof err);
  } else {
    rc = shardd__backend_host_create(cli->devices ? cli->devices : 1,
                                     cli->device_memory, out, err, sizeof err);
  }
  if (rc != SHARDD_OK)
    fprintf(stderr, "shardd: %s backend: %s\n", want_cuda ? "cuda" : "host", err);
  return rc;
}

/* Whether the service manager keeps a file descriptor store for this
 * daemon: $NOTIFY_SOCKET to send to, and $FDSTORE (systemd 254 and later
 * set it to FileDescriptorStoreMax=) above 0; and a backend whose memory
 * memfds hold (host). Without one the daemon runs as it always did. */
static int fd_store_wanted(const shardd__backend *backend) {
  const char *n = getenv("NOTIFY_SOCKET"), *m = getenv("FDSTORE");
  return backend->ops->wrap_fd != NULL && n && n[0] && m &&
         strtoul(m, NULL, 10) > 0;
}

/* What the service manager passed at start (LISTEN_FDS): a listener
 * systemd's socket unit made, and with the fd store, the descriptors a
 * previous daemon stored (adopted later, into *kept: *nkept of them,
 * with their names). */
typedef struct {
  shardd__fdstore_fd *kept;
  size_t nkept;
  char **names;
  int n;
} passed_fds;

/* Socket activation: a listener systemd passed becomes opts->listen_fd,
 * and the path it is bound to opts->socket_path (borrowed from a static
 * buffer, live until exit). *activated says whether one was passed. More
 * than one listener, or (without the fd store) any other fd, is refused
 * with the reason on stderr. */
static shardd_err adopt_activated_socket(shardd__server_opts *opts, int *activated,
                                         int fd_store, passed_fds *pf) {
  static char activated_path[sizeof(((struct sockaddr_un *)0)->sun_path)];
  char **names = NULL;
  int nfds = shardd__sd_listen_fds_names(1, &names);
  int listener = -1, others = 0;
  *activated = 0;
  pf->names = names;
  pf->n = nfds;
  if (nfds < 0) {
    fprintf(stderr, "shardd: malformed LISTEN_PID or LISTEN_FDS\n");
    return SHARDD_E_INVAL;
  }
  if (nfds > 0 && fd_store &&
      (pf->kept = calloc((size_t)nfds, sizeof *pf->kept)) == NULL) {
    fprintf(stderr, "shardd: out of memory\n");
    return SHARDD_E_NO_MEMORY;
  }
  for (int i = 0; i < nfds; i++) {
    int fd = SHARDD_SD_LISTEN_FDS_START + i;
    if (shardd__sd_is_unix_listener(fd) && listener < 0) {
      listener = fd;
    } else if (fd_store && !shardd__sd_is_unix_listener(fd)) {
      pf->kept[pf->nkept++] =
          (shardd__fdstore_fd){fd, names ? names[i] : "unknown"};
    } else {
      others++;
    }
  }
  if (others > 0 || (nfds > 0 && listener < 0 && !fd_store)) {
    fprintf(stderr, "shardd: socket activation passed %d fds; want one unix "
            "stream listener\n", nfds);
    return SHARDD_E_INVAL;
  }
  if (listener < 0)
    return SHARDD_OK;
  *activated = 1;
  opts->listen_fd = listener;
  struct sockaddr_un sa;
  socklen_t len = sizeof sa;
  if (getsockname(listener, (struct sockaddr *)&sa, &len) == 0 && sa.sun_path[0])
    snprintf(activated_path, sizeof activated_path, "%s", sa.sun_path);
  if (activated_path[0])
    opts->socket_path = activated_path;
  return SHARDD_OK;
}

static void passed_free(passed_fds *pf) {
  for (int i = 0; pf->names && i < pf->n; i++)
    free(pf->names[i]);
  free(pf->names);
  free(pf->kept);
}

/* A job rebuilt from the fd store waits for its trainers as a restored
 * one does. */
static void fdstore_adopted(void *arg, shardd__job *job, uint64_t step) {
  shardd__server *srv = arg;
  shardd__log(2, "job \"%s\" resumed from the fd store at step %" PRIu64
              " (its memory kept by the service manager, not copied)",
              job->name, step);
  shardd__jobs_unclaimed(&srv->d.jobs, job, shardd__server_now(srv), 0);
}

/* Starts the server on loop and restores --restore into it. On failure
 * the reason is on stderr and the server is stopped, drained and freed
 * with the loop closed: the caller only exits 1. */
static shardd_err start_server(shardd__server *srv, uv_loop_t *loop,
                               shardd__backend *backend, const shardd__cli *cli,
                               passed_fds *pf) {
  char err[512];
  shardd_err rc = shardd__server_init(srv, loop, backend, &cli->opts, err, sizeof err);
  if (rc != SHARDD_OK) {
    fprintf(stderr, "shardd: %s\n", err);
    for (size_t i = 0; i < pf->nkept; i++)
      close(pf->kept[i].fd);
  } else {
    /* the fd store first: it takes precedence over exit checkpoints */
    if (srv->d.fdstore && pf->nkept > 0) {
      shardd__log(2, "fd store: %zu descriptor%s handed back", pf->nkept,
                  pf->nkept == 1 ? "" : "s");
      int refused = shardd__fdstore_adopt(srv->d.fdstore, pf->kept, pf->nkept,
                                          fdstore_adopted, srv);
      if (refused > 0)
        shardd__log(0, "fd store: %d job%s not resumed (each named above); "
                    "serving the others", refused, refused == 1 ? "" : "s");
    }
    int failed = cli->restore ? restore_all(srv, cli->restore,
                                            same_dir(cli->restore,
                                                     cli->checkpoint_on_exit))
                              : 0;
    if (failed > 0)
      shardd__log(0, "--restore %s: %d job%s not restored (each named above); "
                  "serving the others", cli->restore, failed, failed == 1 ? "" : "s");
    return SHARDD_OK;
  }
  uv_run(loop, UV_RUN_DEFAULT);
  shardd__server_free(srv);
  uv_loop_close(loop);
  return rc;
}

/* The log line and systemd's READY=1: the daemon serves from here on. */
static void announce(const shardd__server *srv, const shardd__backend *backend,
                     int activated) {
  char err[512];
  shardd__log(2, "shardd %s serving on %s (%s backend, %d device%s%s)",
              SHARDD_VERSION, srv->socket_path, backend->name, backend->ndevices,
              backend->ndevices == 1 ? "" : "s", activated ? ", socket-activated" : "");
  char state[256];
  snprintf(state, sizeof state, "READY=1\nSTATUS=serving on %s\nMAINPID=%d",
           srv->socket_path, (int)getpid());
  if (shardd__sd_notify(state, err, sizeof err) != SHARDD_OK)
    shardd__log(1, "sd_notify: %s", err);
}

/* --checkpoint-on-exit DIR made (or found) now, at start: a parent that
 * does not exist, or a DIR the daemon cannot write, was found only at the
 * stop, which then wrote no job: every job lost at the first restart, and
 * the daemon had served as if all were well. 0 when DIR is a directory the
 * daemon may write into. */
static int exit_dir_ready(const char *dir) {
  struct stat st;
  if (mkdir(dir, 0750) != 0 && errno != EEXIST) {
    shardd__log(0, "--checkpoint-on-exit %s: cannot be made (%s): a stop "
                "would write no job and lose them all; create its parent "
                "(the unit's StateDirectory=) or name another; not serving",
                dir, strerror(errno));
    return -1;
  }
  if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode) ||
      access(dir, W_OK | X_OK) != 0) {
    shardd__log(0, "--checkpoint-on-exit %s: %s: a stop would write no job "
                "and lose them all; not serving", dir,
                stat(dir, &st) != 0 ? strerror(errno)
                : !S_ISDIR(st.st_mode) ? "not a directory"
                : "not writable by the daemon");
    return -1;
  }
  return 0;
}

/* --checkpoint-on-exit DIR: every job to DIR/JOB, all at once (their
 * files on libuv's pool: shardd__jobs_checkpoint_many). 0, or 1 when DIR
 * could not be made or any job failed (each is logged). */
static int checkpoint_on_exit(shardd__server *srv, const char *dir) {
  /* The loop has drained: no collective runs, every session is closed,
   * and the jobs are still there (no release while stopping). */
  if (mkdir(dir, 0750) != 0 && errno != EEXIST) {
    shardd__log(0, "--checkpoint-on-exit %s: %s", dir, strerror(errno));
    return 1;
  }
  job_list l = {0};
  shardd__registry_each_job(&srv->d.reg, collect_job, &l);
  size_t n = l.n;
  enum { ERRLEN = 1024 };
  char **dirs = calloc(n ? n : 1, sizeof *dirs);
  shardd_err *rcs = calloc(n ? n : 1, sizeof *rcs);
  char *errs = calloc(n ? n : 1, ERRLEN);
  int failed = l.failed;
  if (l.failed || dirs == NULL || rcs == NULL || errs == NULL) {
    shardd__log(0, "--checkpoint-on-exit %s: out of memory; no job written",
                dir);
    failed = 1;
    n = 0;
  }
  for (size_t k = 0; k < n; k++)
    if ((dirs[k] = exit_dir(dir, l.jobs[k])) == NULL)
      failed = 1;
  if (!failed) {
    uint64_t bytes;
    shardd__jobs_checkpoint_many(&srv->d.jobs, l.jobs, dirs, n, rcs, errs,
                                 ERRLEN, &bytes);
  }
  for (size_t k = 0; k < n; k++) {
    if (failed || rcs[k] != SHARDD_OK) {
      shardd__log(0, "checkpoint of job \"%s\" failed: %s", l.jobs[k]->name,
                  failed ? "out of memory" : errs + k * ERRLEN);
      failed = 1;
      continue;
    }
    /* a marker of the checkpoint this one replaced is stale */
    char marker[4096];
    snprintf(marker, sizeof marker, "%s/%s", dirs[k], SHARDD__SUPERSEDED_FILE);
    unlink(marker);
  }
  for (size_t k = 0; k < n; k++)
    free(dirs[k]);
  free(dirs);
  free(rcs);
  free(errs);
  free(l.jobs);
  return failed;
}

int main(int argc, char **argv) {
  /* static: the server borrows its options, job specs included, until exit */
  static shardd__cli cli;
  int rc = shardd__cli_parse(argc, argv, &cli);
  if (rc != SHARDD__CLI_RUN)
    return rc;
  prepare_process();
  if (cli.checkpoint_on_exit && exit_dir_ready(cli.checkpoint_on_exit) != 0)
    return 1;

  shardd__backend *backend;
  int activated;
  passed_fds pf = {NULL, 0, NULL, 0};
  if (create_backend(&cli, &backend) != SHARDD_OK)
    return 1;
  cli.opts.fd_store = fd_store_wanted(backend);
  if (adopt_activated_socket(&cli.opts, &activated, cli.opts.fd_store, &pf) !=
      SHARDD_OK) {
    for (size_t i = 0; i < pf.nkept; i++)
      close(pf.kept[i].fd);
    passed_free(&pf);
    backend->ops->destroy(backend);
    return 1;
  }
  /* from the first region on: every one is stored as it is made */
  if (cli.opts.fd_store)
    shardd__backend_host_persist(backend, SHARDD__PERSIST_ON);

  uv_loop_t *loop = uv_default_loop();
  shardd__server srv;
  shardd_err started = start_server(&srv, loop, backend, &cli, &pf);
  passed_free(&pf);
  if (started != SHARDD_OK)
    return 1;
  announce(&srv, backend, activated);

  uv_run(loop, UV_RUN_DEFAULT);

  char err[512];
  /* what the jobs hold stays in the store for the next start: freeing it
   * now neither takes it out nor punches its pages away */
  if (cli.opts.fd_store)
    shardd__backend_host_persist(backend, SHARDD__PERSIST_DETACHED);
  shardd__sd_notify("STOPPING=1", err, sizeof err);
  int status = cli.checkpoint_on_exit ? checkpoint_on_exit(&srv, cli.checkpoint_on_exit) : 0;
  shardd__server_free(&srv);
  uv_loop_close(loop);
  shardd__cli_free(&cli);
  shardd__log(2, "stopped");
  return status;
}
