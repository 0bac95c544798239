/* log.h — the daemon's log lines, on stderr with a syslog priority prefix
 * (the journal stamps the time itself and filters by the prefix). A leaf
 * module: every layer may log, and logging calls nothing back.
 *
 * The level is process-wide, set once at start (--log-level) before any
 * thread logs; lines are written whole by one fprintf. */
#ifndef SHARDD_LOG_H
#define SHARDD_LOG_H

enum { SHARDD__LOG_ERROR, SHARDD__LOG_WARN, SHARDD__LOG_INFO, SHARDD__LOG_DEBUG };

/* Lines above level are dropped (default 2, info). */
void shardd__log_set_level(int level);

/* Logs one line. Every control byte (below 0x20, and 0x7f) of the
 * formatted line is written as \xNN and every backslash as \\
 * (shardd__escape, escape.h): a newline in a client's job name forged a log
 * line of its own. */
void shardd__log(int level, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

#endif /* SHARDD_LOG_H */
