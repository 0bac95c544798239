/* asan_death.h — whether AddressSanitizer reports a bad access: the access
 * runs in a forked child (the report ends the process, as abort_on_error
 * makes it a SIGABRT and its default an exit status 1), and the parent
 * reads the report the child wrote to stderr. For the bump allocators'
 * poisoning (common/poison.h); an ASan build only. */
#ifndef SHARDD_TEST_ASAN_DEATH_H
#define SHARDD_TEST_ASAN_DEATH_H

#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

/* 1 when fn(arg) in a child made ASan report kind (e.g.
 * "use-after-poison"), 0 when the child went on to exit 0 or died
 * otherwise; what the child wrote is in report (NUL-terminated). */
static int asan_reports(void (*fn)(void *), void *arg, const char *kind,
                        char *report, size_t cap) {
  int fds[2];
  report[0] = '\0';
  if (pipe(fds) != 0)
    return 0;
  fflush(NULL);
  pid_t pid = fork();
  if (pid < 0)
    return 0;
  if (pid == 0) {
    close(fds[0]);
    dup2(fds[1], 2);
    alarm(30);
    fn(arg);
    _exit(0);
  }
  close(fds[1]);
  size_t got = 0;
  ssize_t r;
  while ((r = read(fds[0], report + got, cap - 1 - got)) > 0 &&
         (got += (size_t)r) < cap - 1)
    ;
  report[got] = '\0';
  /* drain the rest so the child never blocks on a full pipe */
  char sink[4096];
  while (read(fds[0], sink, sizeof sink) > 0)
    ;
  close(fds[0]);
  int st = 0;
  if (waitpid(pid, &st, 0) != pid)
    return 0;
  int died = WIFSIGNALED(st) || (WIFEXITED(st) && WEXITSTATUS(st) != 0);
  return died && strstr(report, "AddressSanitizer") && strstr(report, kind);
}

#endif /* SHARDD_TEST_ASAN_DEATH_H */
