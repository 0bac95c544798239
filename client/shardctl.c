/* shardctl — the operator's view into shardd: `status` and `inspect`, as
 * text or --json. Exit codes: 0 ok, 1 daemon error, 2 usage, 3 cannot reach
 * the daemon. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "shardd.h"

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

int main(int argc, char **argv) {
  const char *sock = NULL;
  int json = 0;
  double timeout = -1; /* -1: not given */
  int i = 1;
  for (; i < argc && argv[i][0] == '-'; i++) {
    if (!strcmp(argv[i], "--json")) {
      json = 1;
    } else if (!strcmp(argv[i], "--timeout") && i + 1 < argc) {
      if ((timeout = parse_timeout(argv[++i])) < 0)
        return 2;
    } else if (!strcmp(argv[i], "--socket") && i + 1 < argc) {
      sock = argv[++i];
    } else if (!strncmp(argv[i], "--socket=", 9)) {
      sock = argv[i] + 9;
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
  const char *cmd = argv[i++];
  /* Options may follow the command too (shardctl status --json). */
  const char *arg = NULL, *arg2 = NULL;
  long world = 0, from = 0;
  for (; i < argc; i++) {
    if (!strcmp(argv[i], "--json"))
      json = 1;
    else if (!strcmp(argv[i], "--world") && i + 1 < argc) {
      char *end;
      world = strtol(argv[++i], &end, 10);
      if (*end || world < 1 || world > 65536) {
        fprintf(stderr, "shardctl: --world %s: must be 1..65536\n", argv[i]);
        return 2;
      }
    }
    else if (!strcmp(argv[i], "--from") && i + 1 < argc) {
      char *end;
      from = strtol(argv[++i], &end, 10);
      if (*end || end == argv[i] || from < 0 || from > 1000000000) {
        fprintf(stderr, "shardctl: --from %s: must be 0..1000000000\n", argv[i]);
        return 2;
      }
    }
    else if (!strcmp(argv[i], "--timeout") && i + 1 < argc) {
      if ((timeout = parse_timeout(argv[++i])) < 0)
        return 2;
    }
    else if (!strcmp(argv[i], "--socket") && i + 1 < argc)
      sock = argv[++i];
    else if (!strncmp(argv[i], "--socket=", 9))
      sock = argv[i] + 9;
    else if (arg == NULL && argv[i][0] != '-')
      arg = argv[i];
    else if (arg2 == NULL && argv[i][0] != '-')
      arg2 = argv[i];
    else {
      fprintf(stderr, "shardctl: unexpected argument %s\n", argv[i]);
      return 2;
    }
  }
  int is_status = !strcmp(cmd, "status"), is_inspect = !strcmp(cmd, "inspect"),
      is_ping = !strcmp(cmd, "ping"), is_ckpt = !strcmp(cmd, "checkpoint"),
      is_restore = !strcmp(cmd, "restore"), is_release = !strcmp(cmd, "release");
  if (!is_status && !is_inspect && !is_ping && !is_ckpt && !is_restore &&
      !is_release) {
    fprintf(stderr, "shardctl: unknown command %s\n", cmd);
    usage(stderr);
    return 2;
  }
  if (is_inspect && arg == NULL) {
    fprintf(stderr, "shardctl: inspect needs a buffer or view id or name\n");
    return 2;
  }
  if ((is_ckpt && (arg == NULL || arg2 == NULL)) ||
      ((is_restore || is_release) && arg == NULL)) {
    fprintf(stderr, "shardctl: usage: %s\n",
            is_ckpt ? "checkpoint JOB DIR [--timeout S]"
                    : is_release ? "release JOB" : "restore DIR");
    return 2;
  }
  if ((!is_inspect && !is_ckpt && !is_restore && !is_release && arg != NULL) ||
      (!is_ckpt && arg2 != NULL)) {
    fprintf(stderr, "shardctl: %s: too many arguments\n", cmd);
    return 2;
  }
  /* The daemon resolves paths from its own working directory. */
  char absdir[4096];
  const char *dir = is_ckpt ? arg2 : is_restore ? arg : NULL;
  if (dir && dir[0] != '/') {
    char cwd[2048];
    if (getcwd(cwd, sizeof cwd) == NULL) {
      fprintf(stderr, "shardctl: getcwd failed\n");
      return 1;
    }
    snprintf(absdir, sizeof absdir, "%s/%s", cwd, dir);
    dir = absdir;
  }

  char err[1024];
  shardd_client_t *c;
  shardd_connect_opts opts = SHARDD_CONNECT_OPTS_INIT;
  opts.client_name = "shardctl";
  /* not given: the library's ($SHARDD_TIMEOUT, else its default); 0: none */
  opts.timeout_s = timeout < 0 ? 0 : timeout == 0 ? -1 : timeout;
  shardd_err rc = shardd_connect(sock, &opts, &c, err, sizeof err);
  if (rc != SHARDD_OK) {
    fprintf(stderr, "shardctl: %s\n", err);
    return rc == SHARDD_E_CONNECT || rc == SHARDD_E_INVAL || rc == SHARDD_E_IO ||
                   rc == SHARDD_E_TIMEOUT || rc == SHARDD_E_CLOSED
               ? 3
               : 1;
  }
  char *out = NULL;
  if (is_status) {
    rc = json ? shardd_status_json_from(c, (uint32_t)from, &out)
              : shardd_status_text_from(c, (uint32_t)from, &out);
  } else if (is_ckpt || is_restore) {
    char job[256];
    /* --timeout is also how long a checkpoint waits for the job's quiescent
     * point (as it always was); the write that follows runs on the
     * daemon's loop, silent for as long as the data takes, so the call
     * itself has no silence deadline (the connect had one) */
    if (is_ckpt)
      shardd_set_timeout(c, -1);
    rc = is_ckpt ? shardd_checkpoint_wait(c, arg, dir, timeout < 0 ? 60 : timeout)
                 : shardd_restore(c, dir, (uint32_t)world, job, sizeof job);
    if (rc == SHARDD_OK) {
      char line[4600];
      snprintf(line, sizeof line, json ? "{\"job\":\"%s\",\"dir\":\"%s\"}\n"
                                       : "%s: %s\n",
               is_ckpt ? arg : job, dir);
      out = strdup(line);
    }
  } else if (is_release) {
    uint32_t nb = 0, no = 0;
    rc = shardd_release_job(c, arg, &nb, &no);
    if (rc == SHARDD_OK) {
      char line[512];
      snprintf(line, sizeof line,
               json ? "{\"job\":\"%s\",\"buffers\":%u,\"optimizers\":%u}\n"
                    : "%s: released (%u buffers, %u optimizers)\n",
               arg, nb, no);
      out = strdup(line);
    }
  } else if (is_ping) {
    rc = shardd_ping(c);
    if (rc == SHARDD_OK)
      out = strdup(json ? "{\"ok\":true}\n" : "pong\n");
  } else {
    char *end;
    unsigned long long id = strtoull(arg, &end, 10);
    const char *name = NULL;
    if (*end != '\0' || id == 0) {
      id = 0;
      name = arg;
    }
    rc = json ? shardd_inspect_json(c, id, name, &out)
              : shardd_inspect_text(c, id, name, &out);
  }
  int code = 0;
  if (rc != SHARDD_OK) {
    fprintf(stderr, "shardctl: %s: %s\n", shardd_err_name(rc), shardd_last_error(c));
    /* a checkpoint's E_TIMEOUT is the daemon's (no quiescent point in
     * time); any other is the daemon not answering */
    code = rc == SHARDD_E_CLOSED || (rc == SHARDD_E_TIMEOUT && !is_ckpt) ? 3 : 1;
  } else if (out) {
    fputs(out, stdout);
  }
  shardd_free(out);
  shardd_close(c);
  return code;
}
