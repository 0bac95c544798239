/* cli.c — shardd's command line: the option table and usage text, and
 * each option's value checked and stored in a shardd__cli (see cli.h).
 * Every message is "shardd: --flag value: why" on stderr, exit status 2. */
#include "cli.h"

#include <errno.h>
#include <getopt.h>
#include <grp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
          "                            -1 forever); a job whose ranks all finished goes at once\n"
          "  --peer-grace SEC          a rank whose connection closed may come back this long\n"
          "                            before its peers' collectives fail (default 1; 0 at once);\n"
          "                            ranks stuck in each other's collectives fail after it\n"
          "  --max-clients N           concurrent connections (default 1024; root and\n"
          "                            --admin-group get 8 more)\n"
          "  --max-clients-per-uid N   connections one user may hold (default 256)\n"
          "  --hello-timeout SEC       close a connection that sends no Hello (default 10)\n"
          "  --frame-timeout SEC       close one that leaves a frame unfinished (default 30)\n"
          "  --max-partial-bytes SIZE  bytes held in unfinished frames, all clients together\n"
          "                            (default 256M; one user, not root or --admin-group,\n"
          "                            a quarter); past it clients are read no further\n"
          "  --max-reply-bytes SIZE    bytes of replies one connection may leave unread\n"
          "                            before it is read no further (default 16M)\n"
          "  --max-reply-fds N         descriptors of replies it may leave unread (default 64)\n"
          "  --max-reply-bytes-per-uid SIZE\n"
          "                            the same for all connections of one user, not root\n"
          "                            or --admin-group (default 64M)\n"
          "  --max-reply-fds-per-uid N the same for descriptors (default 256)\n"
          "  --job-memory-limit SIZE   bytes one job may hold over all devices (default none)\n"
          "  --uid-memory-limit SIZE   bytes all jobs of one user (not root) may hold\n"
          "                            (default a quarter of the devices' memory; 0 none)\n"
          "  --admin-group GROUP       members may see (status, inspect) every job\n"
          "  --max-jobs N              jobs held at once, lingering ones included (default 4096)\n"
          "  --max-jobs-per-uid N      jobs one user (not root) may hold (default 512)\n"
          "  --max-views N             views held at once, all jobs (default 4194304)\n"
          "  --max-views-per-uid N     views one user (not root) may hold (default a\n"
          "                            quarter of --max-views)\n"
          "  --max-inflight-gathers N  gathers one rank may have queued (default 16)\n"
          "  --max-pending N           collectives one rank may have queued, bucket\n"
          "                            entries included (default 64)\n"
          "  --checkpoint-root DIR     clients may checkpoint/restore only below DIR\n"
          "                            (root) or DIR/UID (any other uid; made for it)\n"
          "  --checkpoint-on-exit DIR  on SIGTERM/SIGINT, checkpoint every job to DIR/JOB\n"
          "  --restore DIR             at start, restore the checkpoint in DIR (or each\n"
          "                            DIR/JOB holding one); DIR the --checkpoint-on-exit\n"
          "                            one: an exit checkpoint its job stepped past\n"
          "                            (a crash since) is skipped and logged\n"
          "  --job-spec FILE           a job spanning several nodes: its world, nodes,\n"
          "                            this daemon's node_rank and rendezvous directory\n"
          "                            (the daemon's uid's or root's, writable by no\n"
          "                            other uid); repeatable, one file per job\n"
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

enum {
  O_SOCKET = 256, O_BACKEND, O_DEVICES, O_DEVMEM, O_TIMEOUT, O_LINGER,
  O_MAXCLIENTS, O_LOGLEVEL, O_FOREGROUND, O_VERSION, O_HELP,
  O_CKPT_EXIT, O_RESTORE, O_JOBMEM, O_UIDMEM, O_ADMIN, O_CKPT_ROOT, O_JOBSPEC, O_MAXGATHERS, O_MAXPENDING, O_MAXJOBS,
  O_HELLO_TO, O_FRAME_TO, O_MAXCLI_UID, O_MAXJOBS_UID, O_MAXPARTIAL,
  O_MAXVIEWS, O_MAXVIEWS_UID, O_PEER_GRACE,
  O_MAXREPLY, O_MAXREPLYFDS, O_MAXREPLY_UID, O_MAXREPLYFDS_UID
};

static const struct option longopts[] = {
    {"socket", required_argument, NULL, O_SOCKET},
    {"backend", required_argument, NULL, O_BACKEND},
    {"devices", required_argument, NULL, O_DEVICES},
    {"device-memory", required_argument, NULL, O_DEVMEM},
    {"collective-timeout", required_argument, NULL, O_TIMEOUT},
    {"job-linger", required_argument, NULL, O_LINGER},
    {"peer-grace", required_argument, NULL, O_PEER_GRACE},
    {"max-clients", required_argument, NULL, O_MAXCLIENTS},
    {"log-level", required_argument, NULL, O_LOGLEVEL},
    {"foreground", no_argument, NULL, O_FOREGROUND},
    {"checkpoint-on-exit", required_argument, NULL, O_CKPT_EXIT},
    {"restore", required_argument, NULL, O_RESTORE},
    {"job-memory-limit", required_argument, NULL, O_JOBMEM},
    {"uid-memory-limit", required_argument, NULL, O_UIDMEM},
    {"admin-group", required_argument, NULL, O_ADMIN},
    {"checkpoint-root", required_argument, NULL, O_CKPT_ROOT},
    {"job-spec", required_argument, NULL, O_JOBSPEC},
    {"max-inflight-gathers", required_argument, NULL, O_MAXGATHERS},
    {"max-pending", required_argument, NULL, O_MAXPENDING},
    {"max-jobs", required_argument, NULL, O_MAXJOBS},
    {"hello-timeout", required_argument, NULL, O_HELLO_TO},
    {"frame-timeout", required_argument, NULL, O_FRAME_TO},
    {"max-clients-per-uid", required_argument, NULL, O_MAXCLI_UID},
    {"max-jobs-per-uid", required_argument, NULL, O_MAXJOBS_UID},
    {"max-partial-bytes", required_argument, NULL, O_MAXPARTIAL},
    {"max-reply-bytes", required_argument, NULL, O_MAXREPLY},
    {"max-reply-fds", required_argument, NULL, O_MAXREPLYFDS},
    {"max-reply-bytes-per-uid", required_argument, NULL, O_MAXREPLY_UID},
    {"max-reply-fds-per-uid", required_argument, NULL, O_MAXREPLYFDS_UID},
    {"max-views", required_argument, NULL, O_MAXVIEWS},
    {"max-views-per-uid", required_argument, NULL, O_MAXVIEWS_UID},
    {"version", no_argument, NULL, O_VERSION},
    {"help", no_argument, NULL, O_HELP},
    {NULL, 0, NULL, 0}};

/* parse_count into a uint32_t option; SHARDD__CLI_RUN or exit status 2. */
static int set_count(const char *flag, const char *s, long hi, uint32_t *out) {
  long v;
  if (parse_count(flag, s, hi, &v) != 0)
    return 2;
  *out = (uint32_t)v;
  return SHARDD__CLI_RUN;
}

/* --hello-timeout and --frame-timeout: seconds, > 0. */
static int set_timeout(const char *flag, const char *s, double *out) {
  if (parse_double(s, out) != 0 || !(*out > 0)) {
    fprintf(stderr, "shardd: --%s %s: must be > 0\n", flag, s);
    return 2;
  }
  return SHARDD__CLI_RUN;
}

/* --admin-group: a group name, else a numeric gid. */
static int set_admin_group(const char *s, shardd__server_opts *o) {
  struct group *g = getgrnam(s);
  char *end;
  long gid = strtol(s, &end, 10);
  if (g)
    o->admin_gid = g->gr_gid;
  else if (*end == '\0' && gid >= 0)
    o->admin_gid = gid;
  else {
    fprintf(stderr, "shardd: --admin-group %s: no such group\n", s);
    return 2;
  }
  return SHARDD__CLI_RUN;
}

/* --job-spec: loads the file now, so a bad one stops the daemon before it
 * serves; one spec per job. */
static int add_jobspec(const char *path, shardd__cli *out) {
  char why[512];
  if (out->nspecs == SHARDD__CLI_MAX_JOBSPECS) {
    fprintf(stderr, "shardd: --job-spec: at most %d\n", SHARDD__CLI_MAX_JOBSPECS);
    return 2;
  }
  shardd__jobspec *s = &out->specs[out->nspecs];
  if (shardd__jobspec_load(path, s, why, sizeof why) != SHARDD_OK) {
    fprintf(stderr, "shardd: --job-spec %s\n", why);
    return 2;
  }
  for (size_t i = 0; i < out->nspecs; i++)
    if (shardd__jobspec_overlap(&out->specs[i], s)) {
      fprintf(stderr, "shardd: --job-spec %s: job \"%s\" has a spec already "
              "(%s)\n", path, s->job, out->specs[i].path);
      return 2;
    }
  out->nspecs++;
  out->opts.jobspecs = out->specs;
  out->opts.njobspecs = out->nspecs;
  return SHARDD__CLI_RUN;
}

/* The options that go to the server as they are (shardd__server_opts). */
static int server_option(int c, const char *arg, shardd__server_opts *o) {
  switch (c) {
  case O_SOCKET:
    o->socket_path = arg;
    return SHARDD__CLI_RUN;
  case O_TIMEOUT:
    if (parse_double(arg, &o->collective_timeout) != 0 ||
        !(o->collective_timeout > 0)) {
      fprintf(stderr, "shardd: --collective-timeout %s: must be > 0\n", arg);
      return 2;
    }
    return SHARDD__CLI_RUN;
  case O_PEER_GRACE:
    if (parse_double(arg, &o->peer_grace) != 0 || !(o->peer_grace >= 0) ||
        !(o->peer_grace <= 86400)) {
      fprintf(stderr, "shardd: --peer-grace %s: must be 0..86400 seconds\n", arg);
      return 2;
    }
    return SHARDD__CLI_RUN;
  case O_HELLO_TO:
    return set_timeout("hello-timeout", arg, &o->hello_timeout);
  case O_FRAME_TO:
    return set_timeout("frame-timeout", arg, &o->frame_timeout);
  case O_LINGER:
    if (parse_double(arg, &o->job_linger) != 0) {
      fprintf(stderr, "shardd: --job-linger %s: not a number\n", arg);
      return 2;
    }
    return SHARDD__CLI_RUN;
  case O_MAXJOBS_UID:
    return set_count("max-jobs-per-uid", arg, 1000000, &o->max_jobs_per_uid);
  case O_MAXCLI_UID:
    return set_count("max-clients-per-uid", arg, 1000000, &o->max_clients_per_uid);
  case O_MAXCLIENTS:
    return set_count("max-clients", arg, 1000000, &o->max_clients);
  case O_MAXJOBS:
    return set_count("max-jobs", arg, 1000000, &o->max_jobs);
  case O_MAXVIEWS:
    return set_count("max-views", arg, 1L << 30, &o->max_views);
  case O_MAXVIEWS_UID:
    return set_count("max-views-per-uid", arg, 1L << 30, &o->max_views_per_uid);
  case O_MAXGATHERS:
    return set_count("max-inflight-gathers", arg, 1024, &o->max_inflight_gathers);
  case O_MAXPENDING:
    return set_count("max-pending", arg, 4096, &o->max_pending);
  case O_LOGLEVEL:
    if ((o->log_level = parse_level(arg)) < 0) {
      fprintf(stderr, "shardd: --log-level %s: error|warn|info|debug\n", arg);
      return 2;
    }
    return SHARDD__CLI_RUN;
  case O_CKPT_ROOT:
    if (arg[0] != '/') {
      fprintf(stderr, "shardd: --checkpoint-root %s: must be absolute\n", arg);
      return 2;
    }
    o->checkpoint_root = arg;
    return SHARDD__CLI_RUN;
  case O_JOBMEM:
    return parse_size("job-memory-limit", arg, &o->job_memory_limit) != 0
               ? 2
               : SHARDD__CLI_RUN;
  case O_UIDMEM:
    if (strcmp(arg, "0") == 0) { /* unlimited, as for no --job-memory-limit */
      o->uid_memory_limit = 0;
      return SHARDD__CLI_RUN;
    }
    return parse_size("uid-memory-limit", arg, &o->uid_memory_limit) != 0
               ? 2
               : SHARDD__CLI_RUN;
  case O_ADMIN:
    return set_admin_group(arg, o);
  case O_MAXPARTIAL:
    return parse_size("max-partial-bytes", arg, &o->max_partial_bytes) != 0
               ? 2
               : SHARDD__CLI_RUN;
  case O_MAXREPLY:
    return parse_size("max-reply-bytes", arg, &o->max_reply_bytes) != 0
               ? 2
               : SHARDD__CLI_RUN;
  case O_MAXREPLY_UID:
    return parse_size("max-reply-bytes-per-uid", arg,
                      &o->max_reply_bytes_per_uid) != 0
               ? 2
               : SHARDD__CLI_RUN;
  case O_MAXREPLYFDS:
    return set_count("max-reply-fds", arg, 1000000, &o->max_reply_fds);
  case O_MAXREPLYFDS_UID:
    return set_count("max-reply-fds-per-uid", arg, 1000000,
                     &o->max_reply_fds_per_uid);
  default:
    usage(stderr); /* getopt_long has named the bad option */
    return 2;
  }
}

/* One option from getopt_long: main's own settings here, the server's in
 * server_option. */
static int apply_option(int c, const char *arg, shardd__cli *out) {
  long v;
  switch (c) {
  case O_BACKEND:
    out->backend = arg;
    if (strcmp(arg, "host") && strcmp(arg, "cuda") && strcmp(arg, "auto")) {
      fprintf(stderr, "shardd: --backend %s: must be host, cuda or auto\n", arg);
      return 2;
    }
    return SHARDD__CLI_RUN;
  case O_DEVICES:
    if (parse_count("devices", arg, 1024, &v) != 0)
      return 2;
    out->devices = (int)v;
    return SHARDD__CLI_RUN;
  case O_DEVMEM:
    return parse_size("device-memory", arg, &out->device_memory) != 0
               ? 2
               : SHARDD__CLI_RUN;
  case O_FOREGROUND: /* the only mode; accepted for systemd units */
    return SHARDD__CLI_RUN;
  case O_CKPT_EXIT:
    out->checkpoint_on_exit = arg;
    return SHARDD__CLI_RUN;
  case O_RESTORE:
    out->restore = arg;
    return SHARDD__CLI_RUN;
  case O_JOBSPEC:
    return add_jobspec(arg, out);
  case O_VERSION:
    printf("shardd %s (protocol %d)\n", SHARDD_VERSION, SHARDD_PROTOCOL_VERSION);
    return 0;
  case O_HELP:
    usage(stdout);
    return 0;
  default:
    return server_option(c, arg, &out->opts);
  }
}

int shardd__cli_parse(int argc, char **argv, shardd__cli *out) {
  *out = (shardd__cli){.opts = SHARDD__SERVER_OPTS_INIT, .backend = "auto"};
  const char *env_sock = getenv("SHARDD_SOCKET");
  if (env_sock && env_sock[0])
    out->opts.socket_path = env_sock;
  int c;
  while ((c = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
    int rc = apply_option(c, optarg, out);
    if (rc != SHARDD__CLI_RUN)
      return rc;
  }
  if (optind < argc) {
    fprintf(stderr, "shardd: unexpected argument %s\n", argv[optind]);
    usage(stderr);
    return 2;
  }
  return SHARDD__CLI_RUN;
}

void shardd__cli_free(shardd__cli *cli) {
  for (size_t i = 0; i < cli->nspecs; i++)
    shardd__jobspec_free(&cli->specs[i]);
  cli->nspecs = 0;
}
