/* test_systemd.c — suite systemd: the unit files under systemd/ as systemd
 * itself reads them (systemd-analyze verify, where installed) and the
 * settings the daemon relies on, checked against each other and against
 * shardd.h, so the service, socket, tmpfiles and sysusers files cannot drift
 * apart (path, owner, mode). Run from the repository root. */
#include <criterion/criterion.h>

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "shardd.h"

#define SERVICE_IN "systemd/shardd.service.in"
#define SOCKET "systemd/shardd.socket"
#define TMPFILES "systemd/shardd.tmpfiles"
#define SYSUSERS "systemd/shardd.sysusers"

/* ---- small helpers ---- */

/* Whole file, NUL-terminated; caller frees. Fails the test when unreadable. */
static char *slurp(const char *path) {
  FILE *f = fopen(path, "rb");
  char *buf = NULL;
  size_t cap = 0, len = 0, n;

  cr_assert_not_null(f, "open %s: %s (tests run from the repository root)",
                     path, strerror(errno));
  do {
    if (cap - len < 4096) {
      cap = cap ? cap * 2 : 8192;
      buf = realloc(buf, cap);
      cr_assert_not_null(buf);
    }
    n = fread(buf + len, 1, cap - len - 1, f);
    len += n;
  } while (n > 0);
  cr_assert_not(ferror(f), "read %s", path);
  fclose(f);
  buf[len] = '\0';
  return buf;
}

static void spit(const char *path, const char *text, mode_t mode) {
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode);
  size_t len = strlen(text);

  cr_assert_geq(fd, 0, "create %s: %s", path, strerror(errno));
  cr_assert_eq(write(fd, text, len), (ssize_t)len, "write %s", path);
  cr_assert_eq(close(fd), 0);
  cr_assert_eq(chmod(path, mode), 0); /* umask would have trimmed it */
}

/* Every occurrence of from replaced by to; caller frees. */
static char *replace_all(const char *s, const char *from, const char *to) {
  size_t nf = strlen(from), nt = strlen(to), count = 0;
  const char *p;
  char *out, *o;

  for (p = s; (p = strstr(p, from)) != NULL; p += nf)
    count++;
  out = malloc(strlen(s) + count * nt + 1);
  cr_assert_not_null(out);
  for (o = out; (p = strstr(s, from)) != NULL; s = p + nf) {
    memcpy(o, s, (size_t)(p - s));
    o += p - s;
    memcpy(o, to, nt);
    o += nt;
  }
  strcpy(o, s);
  return out;
}

/* Whether s still holds an autoconf-style @NAME@ that install would not
 * substitute (only @BINDIR@ is). */
static int has_placeholder(const char *s) {
  const char *p, *q;
  for (p = strchr(s, '@'); p != NULL; p = strchr(p + 1, '@')) {
    for (q = p + 1; (*q >= 'A' && *q <= 'Z') || *q == '_'; q++)
      ;
    if (*q == '@' && q > p + 1)
      return 1;
  }
  return 0;
}

static int find_on_path(const char *name, char *out, size_t cap) {
  const char *path = getenv("PATH");
  const char *p, *end;

  if (path == NULL)
    path = "/usr/local/bin:/usr/bin:/bin";
  for (p = path; *p != '\0'; p = *end ? end + 1 : end) {
    end = strchr(p, ':');
    if (end == NULL)
      end = p + strlen(p);
    if (end == p)
      continue;
    snprintf(out, cap, "%.*s/%s", (int)(end - p), p, name);
    if (access(out, X_OK) == 0)
      return 1;
  }
  return 0;
}

/* Runs argv[0] (a full path) with stdout and stderr into log; returns the
 * exit status, -1 when it did not exit. */
static int run_logged(char *const argv[], const char *log) {
  int status;
  pid_t pid = fork();

  cr_assert_geq(pid, 0, "fork: %s", strerror(errno));
  if (pid == 0) {
    int out = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (out < 0 || dup2(out, 1) < 0 || dup2(out, 2) < 0)
      _exit(126);
    setenv("SYSTEMD_LOG_COLOR", "0", 1);
    execv(argv[0], argv);
    _exit(127);
  }
  cr_assert_eq(waitpid(pid, &status, 0), pid);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* Logs each line of the file at path; returns how many name shardd. In a
 * container the systemd tools may warn about unrelated units or the
 * machine; only lines naming ours count, and when flag they are shown as
 * warnings (for tools that print nothing about a clean file). */
static int log_lines(const char *tool, const char *path, int flag) {
  char *log = slurp(path), *line, *save = NULL;
  int ours_n = 0;

  for (line = strtok_r(log, "\n", &save); line != NULL;
       line = strtok_r(NULL, "\n", &save)) {
    int ours = strstr(line, "shardd") != NULL;
    /* FileDescriptorStorePreserve= is systemd 254's: an older one warns
     * and ignores it, as the unit's comment says */
    if (strstr(line, "Unknown key 'FileDescriptorStorePreserve'"))
      ours = 0;
    if (ours && flag)
      cr_log_warn("%s: %s", tool, line);
    else
      cr_log_info("%s (not ours): %s", tool, line);
    ours_n += ours;
  }
  free(log);
  return ours_n;
}

/* ---- a unit-file reader: just enough of systemd.syntax(7) ---- */

#define MAX_KV 256

struct kv {
  char section[32];
  char key[64];
  char val[256];
};

struct unit {
  struct kv kv[MAX_KV];
  size_t n;
};

static char *trim(char *s) {
  char *e;
  while (*s == ' ' || *s == '\t')
    s++;
  e = s + strlen(s);
  while (e > s && (e[-1] == ' ' || e[-1] == '\t' || e[-1] == '\r'))
    *--e = '\0';
  return s;
}

static void parse_unit(const char *path, struct unit *u) {
  char *text = slurp(path);
  char section[32] = "";
  char *line, *save = NULL;

  u->n = 0;
  for (line = strtok_r(text, "\n", &save); line != NULL;
       line = strtok_r(NULL, "\n", &save)) {
    char *l = trim(line), *eq;
    if (*l == '\0' || *l == '#' || *l == ';')
      continue;
    /* Continuations would need joining; these files do not use them, and a
     * reader that silently split them would test the wrong thing. */
    cr_assert_neq(l[strlen(l) - 1], '\\', "%s: continuation line unsupported",
                  path);
    if (*l == '[') {
      cr_assert_eq(l[strlen(l) - 1], ']', "%s: bad section %s", path, l);
      snprintf(section, sizeof section, "%.*s", (int)(strlen(l) - 2), l + 1);
      continue;
    }
    eq = strchr(l, '=');
    cr_assert_not_null(eq, "%s: not key=value: %s", path, l);
    cr_assert_neq(section[0], '\0', "%s: %s outside a section", path, l);
    cr_assert_lt(u->n, MAX_KV);
    *eq = '\0';
    snprintf(u->kv[u->n].section, sizeof u->kv[u->n].section, "%s", section);
    snprintf(u->kv[u->n].key, sizeof u->kv[u->n].key, "%s", trim(l));
    snprintf(u->kv[u->n].val, sizeof u->kv[u->n].val, "%s", trim(eq + 1));
    u->n++;
  }
  free(text);
}

/* The effective value of a single-valued key: the last assignment wins, and
 * an empty assignment resets it. NULL when unset. */
static const char *get(const struct unit *u, const char *sect, const char *key) {
  const char *v = NULL;
  size_t i;
  for (i = 0; i < u->n; i++)
    if (!strcmp(u->kv[i].section, sect) && !strcmp(u->kv[i].key, key))
      v = u->kv[i].val[0] ? u->kv[i].val : NULL;
  return v;
}

static int has_key_anywhere(const struct unit *u, const char *key) {
  size_t i;
  for (i = 0; i < u->n; i++)
    if (!strcmp(u->kv[i].key, key))
      return 1;
  return 0;
}

/* Whether a list-valued key (After=, Requires=, ...) names word in any of
 * its assignments. */
static int lists(const struct unit *u, const char *sect, const char *key,
                 const char *word) {
  size_t i, n = strlen(word);
  for (i = 0; i < u->n; i++) {
    const char *p;
    if (strcmp(u->kv[i].section, sect) || strcmp(u->kv[i].key, key))
      continue;
    for (p = u->kv[i].val; (p = strstr(p, word)) != NULL; p += n)
      if ((p == u->kv[i].val || p[-1] == ' ') && (p[n] == '\0' || p[n] == ' '))
        return 1;
  }
  return 0;
}

/* Whether any DeviceAllow= assignment's specifier contains s, with r and w. */
static int device_allowed(const struct unit *u, const char *s) {
  size_t i;
  for (i = 0; i < u->n; i++) {
    const char *v = u->kv[i].val, *sp = strchr(v, ' ');
    if (strcmp(u->kv[i].section, "Service") || strcmp(u->kv[i].key, "DeviceAllow"))
      continue;
    if (sp != NULL && strstr(v, s) != NULL && strstr(v, s) < sp &&
        strchr(sp, 'r') && strchr(sp, 'w'))
      return 1;
  }
  return 0;
}

#define ASSERT_KEY(u, sect, key, want)                                        \
  do {                                                                        \
    const char *got_ = get((u), (sect), (key));                               \
    cr_assert_not_null(got_, "[%s] %s= is missing", (sect), (key));           \
    cr_assert_str_eq(got_, (want), "[%s] %s=", (sect), (key));                \
  } while (0)

TestSuite(systemd);

/* ---- systemd-analyze verify ---- */

static char vdir[64];
static char vpath[4][128];

static void verify_cleanup(void) {
  size_t i;
  for (i = 0; i < sizeof vpath / sizeof vpath[0]; i++)
    if (vpath[i][0])
      unlink(vpath[i]);
  if (vdir[0]) {
    char bin[80];
    snprintf(bin, sizeof bin, "%s/bin", vdir);
    rmdir(bin);
    rmdir(vdir);
  }
}

/* systemd-analyze verify (checked with systemd 252) parses both units as
 * pid1 would, follows their dependencies and checks that ExecStart= names an
 * executable; unknown keys and bad values are warnings that still exit 0,
 * hence the stderr check. It checks User=, Group=, SocketUser= and
 * SocketGroup= only for syntax and does not resolve them, so the shardd user,
 * which does not exist on a build machine, needs no stand-in here: the units
 * are verified exactly as installed, with only @BINDIR@ filled in. */
Test(systemd, analyze_verify, .fini = verify_cleanup) {
  char analyze[PATH_MAX], bin[80];
  char *in, *svc, *sock;
  int rc, bad;

  if (!find_on_path("systemd-analyze", analyze, sizeof analyze))
    cr_skip_test("systemd-analyze not found");

  strcpy(vdir, "/tmp/shardd-systemd-XXXXXX");
  cr_assert_not_null(mkdtemp(vdir), "mkdtemp: %s", strerror(errno));
  snprintf(bin, sizeof bin, "%s/bin", vdir);
  cr_assert_eq(mkdir(bin, 0755), 0);
  /* A stand-in binary: verify only needs ExecStart= to be executable, and
   * this keeps the test independent of whether build/shardd is built. */
  snprintf(vpath[0], sizeof vpath[0], "%s/shardd", bin);
  spit(vpath[0], "#!/bin/sh\nexit 0\n", 0755);

  in = slurp(SERVICE_IN);
  cr_assert_not_null(strstr(in, "@BINDIR@"), "ExecStart= should use @BINDIR@");
  svc = replace_all(in, "@BINDIR@", bin); /* as make install's sed does */
  cr_assert_not(has_placeholder(svc), "an unsubstituted @NAME@ remains");
  snprintf(vpath[1], sizeof vpath[1], "%s/shardd.service", vdir);
  spit(vpath[1], svc, 0644);
  sock = slurp(SOCKET);
  snprintf(vpath[2], sizeof vpath[2], "%s/shardd.socket", vdir);
  spit(vpath[2], sock, 0644);
  free(in);
  free(svc);
  free(sock);

  snprintf(vpath[3], sizeof vpath[3], "%s/verify.log", vdir);
  {
    char *argv[] = {analyze, "verify", vpath[1], vpath[2], NULL};
    rc = run_logged(argv, vpath[3]);
  }
  bad = log_lines("systemd-analyze", vpath[3], 1);
  cr_assert_eq(bad, 0, "systemd-analyze verify complained about our units");
  cr_assert_eq(rc, 0, "systemd-analyze verify exited %d", rc);
}

/* ---- what the daemon and the install rely on ---- */

static struct unit svc_u, sock_u;

Test(systemd, service_keys) {
  const char *exec;

  parse_unit(SERVICE_IN, &svc_u);
  ASSERT_KEY(&svc_u, "Service", "Type", "notify");
  exec = get(&svc_u, "Service", "ExecStart");
  cr_assert_not_null(exec, "ExecStart= is missing");
  cr_assert_eq(strncmp(exec, "@BINDIR@/shardd ", 16), 0,
               "ExecStart=%s should run @BINDIR@/shardd", exec);
  cr_assert_not_null(strstr(exec, "--foreground"),
                     "systemd supervises the main pid: --foreground");
  cr_assert(lists(&svc_u, "Unit", "Requires", "shardd.socket"));
  cr_assert(lists(&svc_u, "Unit", "After", "shardd.socket"));
  ASSERT_KEY(&svc_u, "Service", "User", "shardd");
  ASSERT_KEY(&svc_u, "Service", "Group", "shardd");
  ASSERT_KEY(&svc_u, "Service", "RuntimeDirectory", "shardd");
  ASSERT_KEY(&svc_u, "Service", "RuntimeDirectoryPreserve", "yes");
  ASSERT_KEY(&svc_u, "Service", "NoNewPrivileges", "yes");
  ASSERT_KEY(&svc_u, "Service", "ProtectSystem", "strict");
  ASSERT_KEY(&svc_u, "Service", "ProtectHome", "yes");
  ASSERT_KEY(&svc_u, "Service", "PrivateTmp", "yes");
  ASSERT_KEY(&svc_u, "Service", "LimitMEMLOCK", "infinity");
  ASSERT_KEY(&svc_u, "Service", "Restart", "on-failure");
  /* the fd store: every region a memfd, so the descriptor limit bounds it */
  ASSERT_KEY(&svc_u, "Service", "FileDescriptorStoreMax",
             get(&svc_u, "Service", "LimitNOFILE"));
  ASSERT_KEY(&svc_u, "Service", "FileDescriptorStorePreserve", "yes");
  /* PrivateDevices=yes would hide /dev/nvidia*; not even =no is wanted, so
   * a later edit cannot flip it by changing one word. */
  cr_assert_not(has_key_anywhere(&svc_u, "PrivateDevices"),
                "PrivateDevices= must not be set (GPUs)");
  ASSERT_KEY(&svc_u, "Service", "DevicePolicy", "closed");
  cr_assert(device_allowed(&svc_u, "nvidia"), "no DeviceAllow= for nvidia");
  cr_assert(device_allowed(&svc_u, "nvidia-uvm"), "no DeviceAllow= for UVM");
  cr_assert(device_allowed(&svc_u, "nvidiactl"),
            "no DeviceAllow= for nvidiactl");
  cr_assert(device_allowed(&svc_u, "nvidia-frontend"),
            "no DeviceAllow= for /dev/nvidiaN (char-nvidia-frontend)");
  cr_assert(lists(&svc_u, "Install", "WantedBy", "multi-user.target"));
  cr_assert(lists(&svc_u, "Install", "Also", "shardd.socket"));
}

Test(systemd, socket_keys) {
  const char *listen;

  parse_unit(SOCKET, &sock_u);
  listen = get(&sock_u, "Socket", "ListenStream");
  cr_assert_not_null(listen, "ListenStream= is missing");
  /* The daemon, shardctl and libshardd default to this path; the service
   * passes no --socket, so they must agree. */
  cr_assert_str_eq(listen, SHARDD_DEFAULT_SOCKET);
  ASSERT_KEY(&sock_u, "Socket", "SocketMode", "0660");
  cr_assert(lists(&sock_u, "Install", "WantedBy", "sockets.target"));
  cr_assert_null(get(&sock_u, "Socket", "Accept"),
                 "Accept=yes would start one daemon per connection");
}

/* The directory holding the socket: one path, one owner, one mode across
 * the service (RuntimeDirectory=), the socket (DirectoryMode=) and tmpfiles,
 * and the owner exists per sysusers. */
Test(systemd, files_agree) {
  char dir[PATH_MAX], want_dir[PATH_MAX];
  char *tmpf, *sysu, *line, *save = NULL;
  const char *user, *group, *rtmode, *dirmode, *sgroup;
  int found_d = 0, found_u = 0, found_g = 0;

  parse_unit(SERVICE_IN, &svc_u);
  parse_unit(SOCKET, &sock_u);
  user = get(&svc_u, "Service", "User");
  group = get(&svc_u, "Service", "Group");
  rtmode = get(&svc_u, "Service", "RuntimeDirectoryMode");
  dirmode = get(&sock_u, "Socket", "DirectoryMode");
  sgroup = get(&sock_u, "Socket", "SocketGroup");
  cr_assert_not_null(user);
  cr_assert_not_null(group);
  cr_assert_not_null(rtmode, "RuntimeDirectoryMode= unset (default 0755)");
  cr_assert_not_null(dirmode, "DirectoryMode= unset (default 0755)");
  cr_assert_str_eq(rtmode, dirmode, "service and socket disagree on the mode "
                   "of the socket's directory");
  cr_assert_not_null(sgroup, "SocketGroup= unset: socket would be root's");
  cr_assert_str_eq(sgroup, group);

  /* RuntimeDirectory=shardd is /run/shardd; it must hold the socket. */
  snprintf(dir, sizeof dir, "%s", SHARDD_DEFAULT_SOCKET);
  *strrchr(dir, '/') = '\0';
  snprintf(want_dir, sizeof want_dir, "/run/%s",
           get(&svc_u, "Service", "RuntimeDirectory"));
  cr_assert_str_eq(dir, want_dir);

  tmpf = slurp(TMPFILES);
  for (line = strtok_r(tmpf, "\n", &save); line != NULL;
       line = strtok_r(NULL, "\n", &save)) {
    char type[8], path[PATH_MAX], mode[16], u[64], g[64];
    if (line[0] == '#' || line[0] == '\0')
      continue;
    if (sscanf(line, "%7s %4095s %15s %63s %63s", type, path, mode, u, g) != 5)
      continue;
    if (strcmp(path, dir))
      continue;
    found_d = 1;
    cr_assert(!strcmp(type, "d") || !strcmp(type, "D"), "tmpfiles type %s",
              type);
    cr_assert_str_eq(mode, rtmode, "tmpfiles mode vs RuntimeDirectoryMode=");
    cr_assert_str_eq(u, user);
    cr_assert_str_eq(g, group);
  }
  free(tmpf);
  cr_assert(found_d, "%s has no entry for %s", TMPFILES, dir);

  save = NULL;
  sysu = slurp(SYSUSERS);
  for (line = strtok_r(sysu, "\n", &save); line != NULL;
       line = strtok_r(NULL, "\n", &save)) {
    char type[8], name[64];
    if (sscanf(line, "%7s %63s", type, name) != 2 || type[0] == '#')
      continue;
    /* "u name" also creates the group of the same name. */
    if (!strcmp(type, "u") && !strcmp(name, user))
      found_u = 1;
    if ((!strcmp(type, "u") || !strcmp(type, "g")) && !strcmp(name, group))
      found_g = 1;
  }
  free(sysu);
  cr_assert(found_u, "%s does not create user %s", SYSUSERS, user);
  cr_assert(found_g, "%s does not create group %s", SYSUSERS, group);
}

/* ---- sysusers and tmpfiles, applied to a scratch root ---- */

static char sroot[64];

static void root_cleanup(void) {
  char cmd[128];
  if (sroot[0] == '\0')
    return;
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", sroot);
  if (system(cmd) != 0)
    cr_log_warn("could not remove %s", sroot);
}

/* uid and gid of name in root/etc/passwd; 0 when found. */
static int passwd_ids(const char *root, const char *name, long *uid,
                      long *gid) {
  char path[128], *text, *line, *save = NULL;
  size_t n = strlen(name);
  int found = -1;

  snprintf(path, sizeof path, "%s/etc/passwd", root);
  text = slurp(path);
  for (line = strtok_r(text, "\n", &save); line != NULL;
       line = strtok_r(NULL, "\n", &save))
    if (!strncmp(line, name, n) && line[n] == ':' &&
        sscanf(line + n, ":%*[^:]:%ld:%ld:", uid, gid) == 2)
      found = 0;
  free(text);
  return found;
}

/* The snippets as the boot does it: systemd-sysusers creates the user,
 * then systemd-tmpfiles makes /run/shardd with the owner and mode the units
 * expect. --root keeps both off this machine's /etc and /run, and makes
 * tmpfiles resolve the user from the scratch root's passwd. Creating the
 * directory with another owner needs root. */
Test(systemd, sysusers_then_tmpfiles, .fini = root_cleanup) {
  char sysusers[PATH_MAX], tmpfiles[PATH_MAX], cwd[PATH_MAX];
  char su_conf[PATH_MAX + 32], tf_conf[PATH_MAX + 32];
  char etc[96], log[96], dir[160];
  struct stat st;
  long uid, gid;
  int rc;

  if (!find_on_path("systemd-sysusers", sysusers, sizeof sysusers) ||
      !find_on_path("systemd-tmpfiles", tmpfiles, sizeof tmpfiles))
    cr_skip_test("systemd-sysusers or systemd-tmpfiles not found");
  if (geteuid() != 0)
    cr_skip_test("needs root to chown in a scratch root");
  cr_assert_not_null(getcwd(cwd, sizeof cwd));
  snprintf(su_conf, sizeof su_conf, "%s/%s", cwd, SYSUSERS);
  snprintf(tf_conf, sizeof tf_conf, "%s/%s", cwd, TMPFILES);

  strcpy(sroot, "/tmp/shardd-root-XXXXXX");
  cr_assert_not_null(mkdtemp(sroot), "mkdtemp: %s", strerror(errno));
  snprintf(etc, sizeof etc, "%s/etc", sroot);
  cr_assert_eq(mkdir(etc, 0755), 0);
  snprintf(log, sizeof log, "%s/tool.log", sroot);

  {
    char root_opt[96];
    char *argv[] = {sysusers, root_opt, su_conf, NULL};
    snprintf(root_opt, sizeof root_opt, "--root=%s", sroot);
    rc = run_logged(argv, log);
    log_lines("systemd-sysusers", log, 0); /* it reports what it created */
    cr_assert_eq(rc, 0, "systemd-sysusers exited %d", rc);
  }
  cr_assert_eq(passwd_ids(sroot, "shardd", &uid, &gid), 0,
               "sysusers did not create user shardd");
  {
    char root_opt[96];
    char *argv[] = {tmpfiles, root_opt, "--create", tf_conf, NULL};
    snprintf(root_opt, sizeof root_opt, "--root=%s", sroot);
    rc = run_logged(argv, log);
    cr_assert_eq(log_lines("systemd-tmpfiles", log, 1), 0,
                 "systemd-tmpfiles complained about our snippet");
    cr_assert_eq(rc, 0, "systemd-tmpfiles exited %d", rc);
  }
  snprintf(dir, sizeof dir, "%s%s", sroot, "/run/shardd");
  cr_assert_eq(stat(dir, &st), 0, "%s: %s", dir, strerror(errno));
  cr_assert(S_ISDIR(st.st_mode));
  cr_assert_eq(st.st_mode & 07777, 0750, "mode %o", st.st_mode & 07777);
  cr_assert_eq((long)st.st_uid, uid);
  cr_assert_eq((long)st.st_gid, gid);
}

/* ---- the service's own ExecStart=, run: a restart keeps every job ---- */

/* The state directory's tree, gone (the daemon's checkpoints). */
static void rm_rf(const char *path) {
  char cmd[PATH_MAX + 16];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", path);
  cr_assert_eq(system(cmd), 0, "%s", cmd);
}

/* ExecStart='s arguments after the binary, split at spaces, with
 * /var/lib/<StateDirectory> moved to state: into argv (NULL-terminated),
 * the strings in buf. */
static void exec_start_args(const char *exec, const char *state_dir,
                            const char *state, const char **argv, int max,
                            char *buf, size_t cap) {
  char from[PATH_MAX], *save = NULL, *tok;
  char *words = strdup(exec);
  int n = 0;
  size_t used = 0;
  snprintf(from, sizeof from, "/var/lib/%s", state_dir);
  cr_assert_not_null(words);
  for (tok = strtok_r(words, " ", &save); tok; tok = strtok_r(NULL, " ", &save)) {
    if (tok == words)
      continue; /* @BINDIR@/shardd: the harness runs the built one */
    cr_assert_lt(n, max - 1);
    argv[n++] = buf + used;
    if (!strncmp(tok, from, strlen(from)))
      used += (size_t)snprintf(buf + used, cap - used, "%s%s", state,
                               tok + strlen(from)) + 1;
    else
      used += (size_t)snprintf(buf + used, cap - used, "%s", tok) + 1;
    cr_assert_lt(used, cap);
  }
  argv[n] = NULL;
  free(words);
}

/* The value after flag in argv, NULL when it is not there. */
static const char *arg_of(const char *const *argv, const char *flag) {
  for (; *argv; argv++)
    if (!strcmp(*argv, flag) && argv[1])
      return argv[1];
  return NULL;
}

#define UNIT_NUMEL 1000

/* One rank of job "unit-job" registers (or attaches), then takes steps
 * SGD steps. */
static void unit_train(const test_daemon *d, int steps) {
  shardd_client_t *c = test_connect(d, "unit-job", 0, 1);
  shardd_buffer_info b;
  uint64_t v, opt;
  int64_t shape[1] = {UNIT_NUMEL};
  cr_assert_eq(shardd_buffer_register(c, "flat", SHARDD_DTYPE_FP32, UNIT_NUMEL, &b),
               SHARDD_OK, "%s", shardd_last_error(c));
  cr_assert_eq(shardd_view_register(c, b.id, "w", 0, UNIT_NUMEL, shape, 1, &v),
               SHARDD_OK, "%s", shardd_last_error(c));
  shardd_param_ref refs[1] = {{v, "w"}};
  shardd_param_group g = {refs, 1, {0}};
  shardd_hparams hp = {.set = SHARDD_HP_LR, .lr = 0.1};
  cr_assert_eq(shardd_optimizer_register(c, "sgd", SHARDD_OPTIM_SGD, &hp, &g, 1, &opt),
               SHARDD_OK, "%s", shardd_last_error(c));
  for (int s = 0; s < steps; s++) {
    cr_assert_eq(shardd_gather(c, b.id), SHARDD_OK, "%s", shardd_last_error(c));
    for (uint64_t i = 0; i < b.padded_numel; i++)
      ((float *)b.grad)[i] = 1.0f;
    cr_assert_eq(shardd_scatter(c, b.id, SHARDD_REDUCE_MEAN), SHARDD_OK, "%s",
                 shardd_last_error(c));
    cr_assert_eq(shardd_step(c, opt, NULL, NULL), SHARDD_OK, "%s",
                 shardd_last_error(c));
  }
  shardd_close(c);
}

/* The daemon's job "unit-job": its optimizer's steps, -1 when it has none. */
static int64_t unit_steps(const test_daemon *d) {
  char cmd[256], *out = NULL, *errs = NULL;
  snprintf(cmd, sizeof cmd, "--socket %s --json status", d->sock);
  cr_assert_eq(test_shardctl(NULL, cmd, &out, &errs), 0, "%s", errs);
  tj *j = tj_parse(out);
  cr_assert_not_null(j, "%s", out);
  const tj *jobs = tj_need(j, "jobs", TJ_ARR);
  int64_t steps = -1;
  for (size_t i = 0; i < jobs->n; i++)
    if (!strcmp(tj_need(jobs->kids[i], "name", TJ_STR)->str, "unit-job")) {
      const tj *opts = tj_need(jobs->kids[i], "optimizers", TJ_ARR);
      cr_assert_eq(opts->n, 1, "%s", out);
      steps = (int64_t)tj_need(opts->kids[0], "steps", TJ_NUM)->num;
    }
  tj_free(j);
  free(out);
  free(errs);
  return steps;
}

/* systemctl restart (an upgrade, Restart=on-failure after a clean stop) of
 * the shipped unit: the daemon run with ExecStart='s flags (its state
 * directory moved to a scratch one) keeps the job and its step count
 * across the stop, and says at which step it resumed. */
Test(systemd, a_restart_of_the_unit_keeps_every_job, .timeout = 60) {
  const char *argv[32];
  char buf[4096], state[] = "/tmp/shardd-unit-XXXXXX";
  test_daemon d;

  parse_unit(SERVICE_IN, &svc_u);
  const char *exec = get(&svc_u, "Service", "ExecStart");
  const char *sd = get(&svc_u, "Service", "StateDirectory");
  cr_assert_not_null(exec);
  cr_assert_not_null(sd, "StateDirectory= is missing");
  cr_assert_not_null(mkdtemp(state));
  exec_start_args(exec, sd, state, argv, 32, buf, sizeof buf);
  const char *out = arg_of(argv, "--checkpoint-on-exit");
  const char *in = arg_of(argv, "--restore");
  cr_assert_not_null(out, "ExecStart=%s: no --checkpoint-on-exit, a stop drops "
                     "every job", exec);
  cr_assert_not_null(in, "ExecStart=%s: no --restore, a start brings back no "
                     "job", exec);
  cr_assert_str_eq(out, in, "ExecStart=%s: --restore must read what "
                   "--checkpoint-on-exit writes", exec);
  cr_assert_eq(strncmp(out, state, strlen(state)), 0, "ExecStart=%s: the exit "
               "checkpoint must be below StateDirectory= (the only place "
               "ProtectSystem=strict lets the daemon write)", exec);

  test_daemon_start(&d, argv);
  unit_train(&d, 3);
  cr_assert_eq(test_daemon_terminate(&d), 0, "the stop failed");
  test_daemon_stop(&d);

  test_daemon_start(&d, argv);
  cr_assert_eq(unit_steps(&d), 3, "the restart lost the job's steps");
  cr_assert(test_daemon_log_has(&d, "job \"unit-job\" restored from"));
  cr_assert(test_daemon_log_has(&d, "at step 3"));
  unit_train(&d, 1); /* the trainers attach and go on */
  cr_assert_eq(unit_steps(&d), 4);
  cr_assert_eq(test_daemon_stop(&d), 0);
  rm_rf(state);
}

/* The unit's flags with a StateDirectory= that is not there (a unit run by
 * hand, a path mistyped): the daemon used to serve, then at the stop write
 * no job ("--checkpoint-on-exit ...: No such file or directory") and lose
 * them all. It refuses to start instead, naming the flag and the path. */
Test(systemd, an_exit_checkpoint_directory_that_cannot_be_made_stops_the_start,
     .timeout = 30) {
  const char *args[32];
  char *argv[40];
  char buf[4096], root[] = "/tmp/shardd-unit-XXXXXX", state[PATH_MAX];
  char sock[PATH_MAX], log[PATH_MAX];

  parse_unit(SERVICE_IN, &svc_u);
  const char *exec = get(&svc_u, "Service", "ExecStart");
  const char *sd = get(&svc_u, "Service", "StateDirectory");
  cr_assert_not_null(exec);
  cr_assert_not_null(sd);
  cr_assert_not_null(mkdtemp(root));
  snprintf(state, sizeof state, "%s/missing/state", root);
  snprintf(sock, sizeof sock, "%s/shardd.sock", root);
  snprintf(log, sizeof log, "%s/shardd.log", root);
  exec_start_args(exec, sd, state, args, 32, buf, sizeof buf);
  const char *out = arg_of(args, "--checkpoint-on-exit");
  cr_assert_not_null(out);
  int n = 0;
  argv[n++] = (char *)test_bin("SHARDD_BIN", "build/shardd");
  argv[n++] = "--socket";
  argv[n++] = sock;
  for (int k = 0; args[k]; k++)
    argv[n++] = (char *)args[k];
  argv[n] = NULL;
  int status = run_logged(argv, log);
  char *text = slurp(log);
  char want[PATH_MAX + 64];
  snprintf(want, sizeof want, "--checkpoint-on-exit %s: cannot be made", out);
  cr_expect_eq(status, 1, "exit status %d; log:\n%s", status, text);
  cr_expect_not_null(strstr(text, want), "log:\n%s", text);
  cr_expect_not_null(strstr(text, "not serving"), "log:\n%s", text);
  free(text);
  rm_rf(root);
}
