/* main.c — shardd's command line, backend choice, systemd readiness and
 * socket activation, and the loop's run and teardown. */
#include <errno.h>
#include <getopt.h>
#include <grp.h>
#include <inttypes.h>
#include <math.h>
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
#include "log.h"
#include "strbuf.h"
#include "sdnotify.h"
#include "server.h"

static void usage(FILE *f) {
  fprintf(f,
          "usage: shardd [options]\n"
          "  --socket PATH             listen here (default %s; $SHARDD_SOCKET)\n"
          "  --backend host|cuda|auto  memory backend (default auto: cuda when a GPU is found)\n"
          "  --devices N               devices to manage (host: virtual arenas, default 1;\n"
          "                            cuda: first N GPUs, default all)\n"
          "  --device-memory SIZE      host arena capacity per device (e.g. 8G; default RAM/N)\n"
          "  --collective-timeout SEC  how long a collective waits for all ranks (default 300)\n"
          "  --job-linger SEC          keep a job this long after its last client (default 600;\n"
          "                            -1 forever)\n"
          "  --max-clients N           concurrent connections (default 1024; root and\n"
          "                            --admin-group get 8 more)\n"
          "  --max-clients-per-uid N   connections one user may hold (default 256)\n"
          "  --hello-timeout SEC       close a connection that sends no Hello (default 10)\n"
          "  --frame-timeout SEC       close one that leaves a frame unfinished (default 30)\n"
          "  --job-memory-limit SIZE   bytes one job may hold over all devices (default none)\n"
          "  --admin-group GROUP       members may see (status, inspect) every job\n"
          "  --max-jobs N              jobs held at once, lingering ones included (default 4096)\n"
          "  --max-jobs-per-uid N      jobs one user (not root) may hold (default 512)\n"
          "  --max-inflight-gathers N  gathers one rank may have queued (default 16)\n"
          "  --checkpoint-root DIR     clients may checkpoint/restore only below DIR\n"
          "  --checkpoint-on-exit DIR  on SIGTERM/SIGINT, checkpoint every job to DIR/JOB\n"
          "  --restore DIR             at start, restore the checkpoint in DIR (or each\n"
          "                            DIR/JOB holding one)\n"
          "  --job-spec FILE           a job spanning several nodes: its world, nodes,\n"
          "                            this daemon's node_rank and rendezvous directory\n"
          "                            (repeatable, one file per job)\n"
          "  --log-level LEVEL         error|warn|info|debug (default info)\n"
          "  --foreground              run in the foreground (the only mode; for systemd)\n"
          "  --version, --help\n",
          SHARDD_DEFAULT_SOCKET);
}

/* A byte count with an optional K/M/G/T suffix (powers of 1024, "KiB" and
 * "KB" too) for --flag, else a message and -1. The product is checked in
 * double before it becomes an integer: converting 1e30 (or inf, or nan)
 * to uint64_t is undefined behaviour, not a saturation. */
static int parse_size(const char *flag, const char *s, uint64_t *out) {
  char *end;
  errno = 0;
  double v = strtod(s, &end);
  /* !(v >= 0) also refuses nan */
  if (end == s || !(v >= 0))
    goto bad;
  if (errno == ERANGE && v < 1)
    v = 0; /* underflow ("1e-400"): less than a byte; overflow is inf */
  double mul = 1;
  switch (*end) {
  case 'k': case 'K': mul = 1024.0; end++; break;
  case 'm': case 'M': mul = 1024.0 * 1024; end++; break;
  case 'g': case 'G': mul = 1024.0 * 1024 * 1024; end++; break;
  case 't': case 'T': mul = 1024.0 * 1024 * 1024 * 1024; end++; break;
  default: break;
  }
  if (*end == 'i' || *end == 'B' || *end == 'b')
    end++;
  if (*end == 'B')
    end++;
  if (*end != '\0')
    goto bad;
  /* 2^64 is exact in double and every double below it fits in uint64_t;
   * inf (from "inf" or an overflow like "1e400") fails here too */
  if (!(v * mul < 18446744073709551616.0)) {
    fprintf(stderr, "shardd: --%s %s: out of range (sizes must be below "
            "16 EiB, 2^64 bytes)\n", flag, s);
    return -1;
  }
  *out = (uint64_t)(v * mul);
  if (*out == 0) {
    fprintf(stderr, "shardd: --%s %s: must be at least 1 byte\n", flag, s);
    return -1;
  }
  return 0;

bad:
  fprintf(stderr, "shardd: --%s %s: not a size (a number of bytes, or with "
          "K, M, G or T, e.g. 8G)\n", flag, s);
  return -1;
}

static int parse_double(const char *s, double *out) {
  char *end;
  errno = 0;
  *out = strtod(s, &end);
  return errno || end == s || *end ? -1 : 0;
}

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
  shardd__server *srv;
  const char *dir;
  int failed;
} exit_ckpt;

static void checkpoint_job(shardd__job *job, void *arg) {
  exit_ckpt *a = arg;
  char err[512];
  char *d = job_dir(a->dir, job->name);
  if (d == NULL || shardd__jobs_checkpoint(&a->srv->d.jobs, job, d, -1, err, sizeof err) != SHARDD_OK) {
    shardd__log(0, "checkpoint of job \"%s\" failed: %s", job->name,
                d ? err : "out of memory");
    a->failed = 1;
  }
  free(d);
}

static int restore_one(shardd__server *srv, const char *dir) {
  char err[1024];
  shardd__job *job;
  if (shardd__checkpoint_restore(&srv->d.reg, dir, -1, 0, &job, err, sizeof err) !=
      SHARDD_OK) {
    shardd__log(0, "restore refused: %s", err);
    return -1;
  }
  shardd__jobs_unclaimed(&srv->d.jobs, job, shardd__server_now(srv), 0);
  shardd__log(2, "job \"%s\" restored from %s", job->name, dir);
  return 0;
}

/* DIR itself, or each DIR/JOB that holds a manifest. */
static int restore_all(shardd__server *srv, const char *dir) {
  char path[4096];
  struct stat st;
  snprintf(path, sizeof path, "%s/manifest", dir);
  if (stat(path, &st) == 0)
    return restore_one(srv, dir);
  DIR *d = opendir(dir);
  if (d == NULL) {
    shardd__log(0, "--restore %s: %s", dir, strerror(errno));
    return -1;
  }
  int rc = 0, n = 0;
  for (struct dirent *e; (e = readdir(d)) != NULL;) {
    if (e->d_name[0] == '.')
      continue;
    snprintf(path, sizeof path, "%s/%s/manifest", dir, e->d_name);
    if (stat(path, &st) != 0) {
      /* A job whose checkpoint vanished must not vanish without a word. */
      snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
      if (stat(path, &st) == 0 && S_ISDIR(st.st_mode))
        shardd__log(1, "--restore: %s has no manifest (an incomplete "
                    "checkpoint, or not one); skipped", path);
      continue;
    }
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    n++;
    if (restore_one(srv, path) != 0)
      rc = -1;
  }
  closedir(d);
  if (n == 0)
    shardd__log(1, "--restore %s: no checkpoint found", dir);
  return rc;
}

/* A whole number in [1, hi] for --flag, else a message and -1. */
static int parse_count(const char *flag, const char *s, long hi, long *out) {
  char *end;
  long v = strtol(s, &end, 10);
  if (*end || v < 1 || v > hi) {
    fprintf(stderr, "shardd: --%s %s: must be 1..%ld\n", flag, s, hi);
    return -1;
  }
  *out = v;
  return 0;
}

static int parse_level(const char *s) {
  static const char *names[] = {"error", "warn", "info", "debug"};
  for (int i = 0; i < 4; i++)
    if (strcmp(s, names[i]) == 0)
      return i;
  return -1;
}

int main(int argc, char **argv) {
  enum { O_SOCKET = 256, O_BACKEND, O_DEVICES, O_DEVMEM, O_TIMEOUT, O_LINGER,
         O_MAXCLIENTS, O_LOGLEVEL, O_FOREGROUND, O_VERSION, O_HELP,
         O_CKPT_EXIT, O_RESTORE, O_JOBMEM, O_ADMIN, O_CKPT_ROOT, O_JOBSPEC, O_MAXGATHERS, O_MAXJOBS,
         O_HELLO_TO, O_FRAME_TO, O_MAXCLI_UID, O_MAXJOBS_UID };
  static const struct option longopts[] = {
      {"socket", required_argument, NULL, O_SOCKET},
      {"backend", required_argument, NULL, O_BACKEND},
      {"devices", required_argument, NULL, O_DEVICES},
      {"device-memory", required_argument, NULL, O_DEVMEM},
      {"collective-timeout", required_argument, NULL, O_TIMEOUT},
      {"job-linger", required_argument, NULL, O_LINGER},
      {"max-clients", required_argument, NULL, O_MAXCLIENTS},
      {"log-level", required_argument, NULL, O_LOGLEVEL},
      {"foreground", no_argument, NULL, O_FOREGROUND},
      {"checkpoint-on-exit", required_argument, NULL, O_CKPT_EXIT},
      {"restore", required_argument, NULL, O_RESTORE},
      {"job-memory-limit", required_argument, NULL, O_JOBMEM},
      {"admin-group", required_argument, NULL, O_ADMIN},
      {"checkpoint-root", required_argument, NULL, O_CKPT_ROOT},
      {"job-spec", required_argument, NULL, O_JOBSPEC},
      {"max-inflight-gathers", required_argument, NULL, O_MAXGATHERS},
      {"max-jobs", required_argument, NULL, O_MAXJOBS},
      {"hello-timeout", required_argument, NULL, O_HELLO_TO},
      {"frame-timeout", required_argument, NULL, O_FRAME_TO},
      {"max-clients-per-uid", required_argument, NULL, O_MAXCLI_UID},
      {"max-jobs-per-uid", required_argument, NULL, O_MAXJOBS_UID},
      {"version", no_argument, NULL, O_VERSION},
      {"help", no_argument, NULL, O_HELP},
      {NULL, 0, NULL, 0}};
  shardd__server_opts opts = SHARDD__SERVER_OPTS_INIT;
  const char *env_sock = getenv("SHARDD_SOCKET");
  if (env_sock && env_sock[0])
    opts.socket_path = env_sock;
  const char *backend_name = "auto";
  int devices = 0;
  uint64_t devmem = 0;
  const char *ckpt_exit = NULL, *restore = NULL;
  enum { MAX_JOBSPECS = 64 };
  static shardd__jobspec specs[MAX_JOBSPECS];
  size_t nspecs = 0;
  int c;
  while ((c = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
    switch (c) {
    case O_SOCKET:
      opts.socket_path = optarg;
      break;
    case O_BACKEND:
      backend_name = optarg;
      if (strcmp(optarg, "host") && strcmp(optarg, "cuda") && strcmp(optarg, "auto")) {
        fprintf(stderr, "shardd: --backend %s: must be host, cuda or auto\n", optarg);
        return 2;
      }
      break;
    case O_DEVICES: {
      long v;
      if (parse_count("devices", optarg, 1024, &v) != 0)
        return 2;
      devices = (int)v;
      break;
    }
    case O_DEVMEM:
      if (parse_size("device-memory", optarg, &devmem) != 0)
        return 2;
      break;
    case O_TIMEOUT:
      if (parse_double(optarg, &opts.collective_timeout) != 0 ||
          !(opts.collective_timeout > 0)) {
        fprintf(stderr, "shardd: --collective-timeout %s: must be > 0\n", optarg);
        return 2;
      }
      break;
    case O_HELLO_TO:
    case O_FRAME_TO: {
      double *to = c == O_HELLO_TO ? &opts.hello_timeout : &opts.frame_timeout;
      if (parse_double(optarg, to) != 0 || !(*to > 0)) {
        fprintf(stderr, "shardd: --%s %s: must be > 0\n",
                c == O_HELLO_TO ? "hello-timeout" : "frame-timeout", optarg);
        return 2;
      }
      break;
    }
    case O_MAXJOBS_UID: {
      long v;
      if (parse_count("max-jobs-per-uid", optarg, 1000000, &v) != 0)
        return 2;
      opts.max_jobs_per_uid = (uint32_t)v;
      break;
    }
    case O_MAXCLI_UID: {
      long v;
      if (parse_count("max-clients-per-uid", optarg, 1000000, &v) != 0)
        return 2;
      opts.max_clients_per_uid = (uint32_t)v;
      break;
    }
    case O_LINGER:
      if (parse_double(optarg, &opts.job_linger) != 0) {
        fprintf(stderr, "shardd: --job-linger %s: not a number\n", optarg);
        return 2;
      }
      break;
    case O_MAXCLIENTS: {
      long v;
      if (parse_count("max-clients", optarg, 1000000, &v) != 0)
        return 2;
      opts.max_clients = (uint32_t)v;
      break;
    }
    case O_LOGLEVEL:
      if ((opts.log_level = parse_level(optarg)) < 0) {
        fprintf(stderr, "shardd: --log-level %s: error|warn|info|debug\n", optarg);
        return 2;
      }
      break;
    case O_FOREGROUND:
      break;
    case O_CKPT_EXIT:
      ckpt_exit = optarg;
      break;
    case O_RESTORE:
      restore = optarg;
      break;
    case O_MAXJOBS: {
      long v;
      if (parse_count("max-jobs", optarg, 1000000, &v) != 0)
        return 2;
      opts.max_jobs = (uint32_t)v;
      break;
    }
    case O_MAXGATHERS: {
      long v;
      if (parse_count("max-inflight-gathers", optarg, 1024, &v) != 0)
        return 2;
      opts.max_inflight_gathers = (uint32_t)v;
      break;
    }
    case O_CKPT_ROOT:
      if (optarg[0] != '/') {
        fprintf(stderr, "shardd: --checkpoint-root %s: must be absolute\n", optarg);
        return 2;
      }
      opts.checkpoint_root = optarg;
      break;
    case O_JOBSPEC: {
      char why[512];
      if (nspecs == MAX_JOBSPECS) {
        fprintf(stderr, "shardd: --job-spec: at most %d\n", MAX_JOBSPECS);
        return 2;
      }
      if (shardd__jobspec_load(optarg, &specs[nspecs], why, sizeof why) != SHARDD_OK) {
        fprintf(stderr, "shardd: --job-spec %s\n", why);
        return 2;
      }
      if (shardd__jobspec_find(specs, nspecs, specs[nspecs].job)) {
        fprintf(stderr, "shardd: --job-spec %s: job \"%s\" has a spec already\n",
                optarg, specs[nspecs].job);
        return 2;
      }
      nspecs++;
      opts.jobspecs = specs;
      opts.njobspecs = nspecs;
      break;
    }
    case O_JOBMEM:
      if (parse_size("job-memory-limit", optarg, &opts.job_memory_limit) != 0)
        return 2;
      break;
    case O_ADMIN: {
      struct group *g = getgrnam(optarg);
      char *end;
      long gid = strtol(optarg, &end, 10);
      if (g)
        opts.admin_gid = g->gr_gid;
      else if (*end == '\0' && gid >= 0)
        opts.admin_gid = gid;
      else {
        fprintf(stderr, "shardd: --admin-group %s: no such group\n", optarg);
        return 2;
      }
      break;
    }
    case O_VERSION:
      printf("shardd %s (protocol %d)\n", SHARDD_VERSION, SHARDD_PROTOCOL_VERSION);
      return 0;
    case O_HELP:
      usage(stdout);
      return 0;
    default:
      usage(stderr);
      return 2;
    }
  }
  if (optind < argc) {
    fprintf(stderr, "shardd: unexpected argument %s\n", argv[optind]);
    usage(stderr);
    return 2;
  }

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

  char err[512];
  shardd__backend *backend = NULL;
  shardd_err rc;
  int want_cuda = strcmp(backend_name, "cuda") == 0 ||
                  (strcmp(backend_name, "auto") == 0 && shardd__cuda_device_count() > 0);
  if (want_cuda) {
    rc = shardd__backend_cuda_create(devices, &backend, err, sizeof err);
  } else {
    rc = shardd__backend_host_create(devices ? devices : 1, devmem, &backend,
                                     err, sizeof err);
  }
  if (rc != SHARDD_OK) {
    fprintf(stderr, "shardd: %s backend: %s\n", want_cuda ? "cuda" : "host", err);
    return 1;
  }

  int nfds = shardd__sd_listen_fds(1);
  char activated_path[sizeof(((struct sockaddr_un *)0)->sun_path)] = "";
  if (nfds > 0) {
    if (nfds > 1 || !shardd__sd_is_unix_listener(3)) {
      fprintf(stderr, "shardd: socket activation passed %d fds; want one unix "
              "stream listener\n", nfds);
      backend->ops->destroy(backend);
      return 1;
    }
    opts.listen_fd = 3;
    struct sockaddr_un sa;
    socklen_t len = sizeof sa;
    if (getsockname(3, (struct sockaddr *)&sa, &len) == 0 && sa.sun_path[0])
      snprintf(activated_path, sizeof activated_path, "%s", sa.sun_path);
    if (activated_path[0])
      opts.socket_path = activated_path;
  }

  uv_loop_t *loop = uv_default_loop();
  shardd__server srv;
  rc = shardd__server_init(&srv, loop, backend, &opts, err, sizeof err);
  if (rc != SHARDD_OK) {
    fprintf(stderr, "shardd: %s\n", err);
    uv_run(loop, UV_RUN_DEFAULT);
    shardd__server_free(&srv);
    uv_loop_close(loop);
    return 1;
  }
  if (restore && restore_all(&srv, restore) != 0) {
    fprintf(stderr, "shardd: --restore %s failed; not serving\n", restore);
    shardd__server_stop(&srv);
    uv_run(loop, UV_RUN_DEFAULT);
    shardd__server_free(&srv);
    uv_loop_close(loop);
    return 1;
  }
  shardd__log(2, "shardd %s serving on %s (%s backend, %d device%s%s)",
              SHARDD_VERSION, srv.socket_path, backend->name, backend->ndevices,
              backend->ndevices == 1 ? "" : "s", nfds > 0 ? ", socket-activated" : "");
  char state[256];
  snprintf(state, sizeof state, "READY=1\nSTATUS=serving on %s\nMAINPID=%d",
           srv.socket_path, (int)getpid());
  if (shardd__sd_notify(state, err, sizeof err) != SHARDD_OK)
    shardd__log(1, "sd_notify: %s", err);

  uv_run(loop, UV_RUN_DEFAULT);

  shardd__sd_notify("STOPPING=1", err, sizeof err);
  int status = 0;
  if (ckpt_exit) {
    /* The loop has drained: no collective runs, every session is closed,
     * and the jobs are still there (no release while stopping). */
    if (mkdir(ckpt_exit, 0750) != 0 && errno != EEXIST) {
      shardd__log(0, "--checkpoint-on-exit %s: %s", ckpt_exit, strerror(errno));
      status = 1;
    } else {
      exit_ckpt a = {&srv, ckpt_exit, 0};
      shardd__registry_each_job(&srv.d.reg, checkpoint_job, &a);
      status = a.failed;
    }
  }
  shardd__server_free(&srv);
  uv_loop_close(loop);
  for (size_t i = 0; i < nspecs; i++)
    shardd__jobspec_free(&specs[i]);
  shardd__log(2, "stopped");
  return status;
}
