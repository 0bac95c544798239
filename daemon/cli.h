/* cli.h — shardd's command line (see shardd --help): the option table, the
 * usage text, and the checks on each value. It fills a shardd__cli with the
 * server's options and the settings main acts on itself; it starts nothing.
 *
 * Ownership: the strings in a shardd__cli are borrowed from argv and the
 * environment (both live until exit); the job specs are the struct's own,
 * freed by shardd__cli_free. opts.jobspecs points into the struct, so it
 * must not move while a server holds those options. */
#ifndef SHARDD_CLI_H
#define SHARDD_CLI_H

#include <stddef.h>
#include <stdint.h>

#include "jobspec.h"
#include "opts.h"

/* --job-spec may be given this many times. */
#define SHARDD__CLI_MAX_JOBSPECS 64

/* shardd__cli_parse's answer when the daemon should go on and run; any
 * other value is the exit status (0 after --help or --version). */
#define SHARDD__CLI_RUN (-1)

typedef struct {
  shardd__server_opts opts; /* socket, limits, timeouts, log level, ... */
  const char *backend;      /* "host", "cuda" or "auto" */
  int devices;              /* --devices; 0: the backend's default */
  uint64_t device_memory;   /* --device-memory; 0: the host backend's default */
  const char *checkpoint_on_exit; /* --checkpoint-on-exit DIR, or NULL */
  const char *restore;            /* --restore DIR, or NULL */
  shardd__jobspec specs[SHARDD__CLI_MAX_JOBSPECS]; /* --job-spec, loaded */
  size_t nspecs;
} shardd__cli;

/* Parses argv (with $SHARDD_SOCKET as the socket's default) into *out.
 * Returns SHARDD__CLI_RUN, or the status to exit with: 0 once --help or
 * --version has printed, 2 for a bad option or value (the message, and
 * for an unknown option the usage, on stderr). Not a shardd_err: what it
 * decides is the process's exit status, and it has said why already. On
 * an exit status the job specs loaded so far are not freed. */
int shardd__cli_parse(int argc, char **argv, shardd__cli *out);

/* Frees the job specs; the rest of *out is borrowed. */
void shardd__cli_free(shardd__cli *cli);

#endif /* SHARDD_CLI_H */
