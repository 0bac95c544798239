/* shardctl — the operator's view into shardd: `status` and `inspect`, as
 * text or --json. Exit codes: 0 ok, 1 daemon error, 2 usage, 3 cannot reach
 * the daemon. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "escape.h"
#include "shardd.h"
#include "strbuf.h"

static void usage(FILE *f) {
  fprintf(f,
          "usage: shardctl [--socket PATH] [--json] [--timeout S] COMMAND\n"
          "  status [--from N]   daemon, devices, jobs, optimizers (256 jobs at most,\n"
          "                      from the N-th in name order; it says how many follow)\n"
          "  inspect ID|NAME     one buffer or view: layout, shards, views, owner\n"
          "  ping                round trip to the daemon\n"
          "  checkpoint JOB DIR [--timeout S]  write the job's shards, state and\n"
          "                      registry to DIR; a live job's at its ranks' next\n"
          "                      quiescent point, waiting up to S s (default 60)\n"
          "  release JOB         free a job nobody is connected to (before a restore)\n"
          "  restore DIR [--world N]  recreate the job checkpointed in DIR (into\n"
          "                      N ranks: shards are keyed by offset, not rank)\n"
          "The socket is --socket, else $SHARDD_SOCKET, else %s.\n"
          "--timeout S: a daemon that answers nothing for S s (stopped, hung)\n"
          "fails the command with exit code 3 (default $SHARDD_TIMEOUT, else %g;\n"
          "0: wait forever). checkpoint waits for the write itself without it.\n",
          SHARDD_DEFAULT_SOCKET, SHARDD_DEFAULT_TIMEOUT);
}

/* --timeout's value: 0..86400 seconds, else a usage error (-1). */
static double parse_timeout(const char *v) {
  char *end;
  double t = strtod(v, &end);
  if (*end || end == v || !(t >= 0 && t <= 86400)) {
    fprintf(stderr, "shardctl: --timeout %s: must be 0..86400 seconds\n", v);
    return -1;
  }
  return t;
}

/* Names, directories and the daemon's messages quoting them are bytes
 * others chose (a job's name is any bytes but NUL, a restored job's comes
 * from its checkpoint): a string value is written inside a JSON string
 * (quotes, backslashes and control bytes escaped) or, for text,
 * escaped by shardd__escape, so a control byte neither drives the
 * operator's terminal nor forges a line of the report. */
static void put_str(shardd__sb *sb, const char *s, int json) {
  if (json) {
    shardd__sb_json_str(sb, s);
    return;
  }
  size_t n = 4 * strlen(s ? s : "") + 1; /* always enough: nothing is cut */
  char *e = malloc(n);
  if (e == NULL) {
    sb->failed = 1;
    return;
  }
  shardd__sb_printf(sb, "%s", shardd__escape(s, e, n));
  free(e);
}

/* "shardctl: WHAT: MSG" on stderr, MSG (the daemon's or the library's
 * words, which may quote a name) escaped as text is. */
static void print_err(const char *what, const char *msg) {
  shardd__sb sb;
  shardd__sb_init(&sb);
  put_str(&sb, msg, 0);
  char *e = shardd__sb_take(&sb);
  if (what)
    fprintf(stderr, "shardctl: %s: %s\n", what, e ? e : "(out of memory)");
  else
    fprintf(stderr, "shardctl: %s\n", e ? e : "(out of memory)");
  free(e);
}

/* A command line, read. */
typedef struct {
  const char *sock;
  int json;
  double timeout; /* -1: not given */
  const char *cmd, *arg, *arg2;
  long world, from;
  int is_status, is_inspect, is_ping, is_ckpt, is_restore, is_release;
  const char *dir; /* a checkpoint's or restore's, made absolute */
  char absdir[4096];
} cli;

/* Reads the options before the command, the command, and what follows it
 * (options may follow the command too: shardctl status --json). -1 to go
 * on, else the exit code. */
static int cli_parse(int argc, char **argv, cli *a) {
  int i = 1;
  for (; i < argc && argv[i][0] == '-'; i++) {
    if (!strcmp(argv[i], "--json")) {
      a->json = 1;
    } else if (!strcmp(argv[i], "--timeout") && i + 1 < argc) {
      if ((a->timeout = parse_timeout(argv[++i])) < 0)
        return 2;
    } else if (!strcmp(argv[i], "--socket") && i + 1 < argc) {
      a->sock = argv[++i];
    } else if (!strncmp(argv[i], "--socket=", 9)) {
      a->sock = argv[i] + 9;
    } else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
      usage(stdout);
      return 0;
    } else {
      fprintf(stderr, "shardctl: unknown option %s\n", argv[i]);
      usage(stderr);
      return 2;
    }
  }
  if (i >= argc) {
    usage(stderr);
    return 2;
  }
  a->cmd = argv[i++];
  for (; i < argc; i++) {
    if (!strcmp(argv[i], "--json"))
      a->json = 1;
    else if (!strcmp(argv[i], "--world") && i + 1 < argc) {
      char *end;
      a->world = strtol(argv[++i], &end, 10);
      if (*end || a->world < 1 || a->world > 65536) {
        fprintf(stderr, "shardctl: --world %s: must be 1..65536\n", argv[i]);
        return 2;
      }
    }
    else if (!strcmp(argv[i], "--from") && i + 1 < argc) {
      char *end;
      a->from = strtol(argv[++i], &end, 10);
      if (*end || end == argv[i] || a->from < 0 || a->from > 1000000000) {
        fprintf(stderr, "shardctl: --from %s: must be 0..1000000000\n", argv[i]);
        return 2;
      }
    }
    else if (!strcmp(argv[i], "--timeout") && i + 1 < argc) {
      if ((a->timeout = parse_timeout(argv[++i])) < 0)
        return 2;
    }
    else if (!strcmp(argv[i], "--socket") && i + 1 < argc)
      a->sock = argv[++i];
    else if (!strncmp(argv[i], "--socket=", 9))
      a->sock = argv[i] + 9;
    else if (a->arg == NULL && argv[i][0] != '-')
      a->arg = argv[i];
    else if (a->arg2 == NULL && argv[i][0] != '-')
      a->arg2 = argv[i];
    else {
      fprintf(stderr, "shardctl: unexpected argument %s\n", argv[i]);
      return 2;
    }
  }
  return -1;
}

/* Checks the command and its arguments, and makes a directory argument
 * absolute. -1 to go on, else the exit code. */
static int cli_check(cli *a) {
  const char *cmd = a->cmd, *arg = a->arg, *arg2 = a->arg2;
  a->is_status = !strcmp(cmd, "status");
  a->is_inspect = !strcmp(cmd, "inspect");
  a->is_ping = !strcmp(cmd, "ping");
  a->is_ckpt = !strcmp(cmd, "checkpoint");
  a->is_restore = !strcmp(cmd, "restore");
  a->is_release = !strcmp(cmd, "release");
  if (!a->is_status && !a->is_inspect && !a->is_ping && !a->is_ckpt &&
      !a->is_restore && !a->is_release) {
    fprintf(stderr, "shardctl: unknown command %s\n", cmd);
    usage(stderr);
    return 2;
  }
  if (a->is_inspect && arg == NULL) {
    fprintf(stderr, "shardctl: inspect needs a buffer or view id or name\n");
    return 2;
  }
  if ((a->is_ckpt && (arg == NULL || arg2 == NULL)) ||
      ((a->is_restore || a->is_release) && arg == NULL)) {
    fprintf(stderr, "shardctl: usage: %s\n",
            a->is_ckpt ? "checkpoint JOB DIR [--timeout S]"
                       : a->is_release ? "release JOB" : "restore DIR");
    return 2;
  }
  if ((!a->is_inspect && !a->is_ckpt && !a->is_restore && !a->is_release &&
       arg != NULL) ||
      (!a->is_ckpt && arg2 != NULL)) {
    fprintf(stderr, "shardctl: %s: too many arguments\n", cmd);
    return 2;
  }
  /* The daemon resolves paths from its own working directory. */
  a->dir = a->is_ckpt ? arg2 : a->is_restore ? arg : NULL;
  if (a->dir && a->dir[0] != '/') {
    char cwd[2048];
    if (getcwd(cwd, sizeof cwd) == NULL) {
      fprintf(stderr, "shardctl: getcwd failed\n");
      return 1;
    }
    snprintf(a->absdir, sizeof a->absdir, "%s/%s", cwd, a->dir);
    a->dir = a->absdir;
  }
  return -1;
}

/* Runs the command on c; what it prints in *out (shardd_free it). */
static shardd_err cli_run(shardd_client_t *c, const cli *a, char **out) {
  shardd_err rc;
  const char *arg = a->arg, *dir = a->dir;
  int json = a->json;
  *out = NULL;
  if (a->is_status) {
    rc = json ? shardd_status_json_from(c, (uint32_t)a->from, out)
              : shardd_status_text_from(c, (uint32_t)a->from, out);
  } else if (a->is_ckpt || a->is_restore) {
    /* root restoring another uid's job is told "UID/NAME": up to 10 + 1 +
     * 255 bytes; a name cut short would be one no release finds */
    char job[320];
    uint64_t step = 0;
    /* --timeout is also how long a checkpoint waits for the job's quiescent
     * point (as it always was); the write that follows runs on the
     * daemon's loop, silent for as long as the data takes, so the call
     * itself has no silence deadline (the connect had one) */
    if (a->is_ckpt)
      shardd_set_timeout(c, -1);
    rc = a->is_ckpt
             ? shardd_checkpoint_wait(c, arg, dir,
                                      a->timeout < 0 ? 60 : a->timeout)
             : shardd_restore_ex(c, dir, (uint32_t)a->world, job, sizeof job,
                                 &step);
    if (rc == SHARDD_OK) {
      /* restore: the step it resumes at, what the operator checks before
       * relaunching */
      shardd__sb sb;
      shardd__sb_init(&sb);
      shardd__sb_printf(&sb, json ? "{\"job\":\"" : "");
      put_str(&sb, a->is_ckpt ? arg : job, json);
      shardd__sb_printf(&sb, json ? "\",\"dir\":\"" : ": ");
      put_str(&sb, dir, json);
      if (a->is_ckpt)
        shardd__sb_printf(&sb, json ? "\"}\n" : "\n");
      else
        shardd__sb_printf(&sb, json ? "\",\"step\":%" PRIu64 "}\n"
                                    : " (step %" PRIu64 ")\n",
                          step);
      *out = shardd__sb_take(&sb);
    }
  } else if (a->is_release) {
    uint32_t nb = 0, no = 0;
    rc = shardd_release_job(c, arg, &nb, &no);
    if (rc == SHARDD_OK) {
      shardd__sb sb;
      shardd__sb_init(&sb);
      shardd__sb_printf(&sb, json ? "{\"job\":\"" : "");
      put_str(&sb, arg, json);
      shardd__sb_printf(&sb,
                        json ? "\",\"buffers\":%u,\"optimizers\":%u}\n"
                             : ": released (%u buffers, %u optimizers)\n",
                        nb, no);
      *out = shardd__sb_take(&sb);
    }
  } else if (a->is_ping) {
    rc = shardd_ping(c);
    if (rc == SHARDD_OK)
      *out = strdup(json ? "{\"ok\":true}\n" : "pong\n");
  } else {
    char *end;
    unsigned long long id = strtoull(arg, &end, 10);
    const char *name = NULL;
    if (*end != '\0' || id == 0) {
      id = 0;
      name = arg;
    }
    rc = json ? shardd_inspect_json(c, id, name, out)
              : shardd_inspect_text(c, id, name, out);
  }
  return rc;
}

int main(int argc, char **argv) {
  static cli a = {.timeout = -1};
  int code = cli_parse(argc, argv, &a);
  if (code < 0)
    code = cli_check(&a);
  if (code >= 0)
    return code;

  char err[1024];
  shardd_client_t *c;
  shardd_connect_opts opts = SHARDD_CONNECT_OPTS_INIT;
  opts.client_name = "shardctl";
  /* not given: the library's ($SHARDD_TIMEOUT, else its default); 0: none */
  opts.timeout_s = a.timeout < 0 ? 0 : a.timeout == 0 ? -1 : a.timeout;
  shardd_err rc = shardd_connect(a.sock, &opts, &c, err, sizeof err);
  if (rc != SHARDD_OK) {
    print_err(NULL, err);
    return rc == SHARDD_E_CONNECT || rc == SHARDD_E_INVAL || rc == SHARDD_E_IO ||
                   rc == SHARDD_E_TIMEOUT || rc == SHARDD_E_CLOSED
               ? 3
               : 1;
  }
  char *out = NULL;
  rc = cli_run(c, &a, &out);
  code = 0;
  if (rc != SHARDD_OK) {
    print_err(shardd_err_name(rc), shardd_last_error(c));
    /* a checkpoint's E_TIMEOUT is the daemon's (no quiescent point in
     * time); any other is the daemon not answering */
    code = rc == SHARDD_E_CLOSED || (rc == SHARDD_E_TIMEOUT && !a.is_ckpt) ? 3 : 1;
  } else if (out) {
    fputs(out, stdout);
  }
  shardd_free(out);
  shardd_close(c);
  return code;
}
