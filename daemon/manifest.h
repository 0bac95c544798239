/* manifest.h — the text of a checkpoint's manifest, below write and
 * restore (inside the checkpoint module; checkpoint.h is its public
 * interface): name encoding, bounded line reading and the seal check.
 * Names are percent-encoded so any byte string survives the
 * space-separated format. */
#ifndef SHARDD_MANIFEST_H
#define SHARDD_MANIFEST_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "shardd.h"
#include "strbuf.h"

#define SHARDD__MANIFEST_FILE "manifest"
/* The first word of a multi-node job's job-level manifest (checkpoint.h);
 * a node's part is an ordinary manifest in DIR/node-N. */
#define SHARDD__JOB_MANIFEST_MAGIC "shardd-job-checkpoint"
#define SHARDD__JOB_MANIFEST_VERSION 1

/* The longest manifest line restore reads (and write produces). The
 * longest one is an optimizer's: its RegisterOptimizer in hex, with its
 * name and step count. A client's registration fits one frame, but a
 * restored one is repacked with new ids and generations (longer varints),
 * so the cap allows a spec of two frames; write refuses past it rather than
 * leave a checkpoint restore would refuse. The manifest comes from a
 * directory the client names, and getline grew its buffer to whatever one
 * line held: a planted manifest without newlines cost its size in memory. */
#define SHARDD__MANIFEST_LINE_MAX ((size_t)4 * SHARDD_MAX_FRAME + 4096)

/* The largest manifest restore reads, checked on its size before a byte is
 * read (write refuses to leave a larger one). Restore holds the text whole
 * while it checks the seal and splits the lines off the loop thread, then
 * the loads and states its lines plan (about three times the text): the
 * cap keeps one restore near 1 GiB. A manifest takes about 40 bytes per
 * shard file and 80 per optimizer state file: 256 MiB is millions of data
 * files, each a file of its own in the directory. A planted 1.5 GB
 * manifest held the loop 4-6 s, and its plans would have held ~4.5 GB. */
#define SHARDD__MANIFEST_MAX ((size_t)256 << 20)

/* Appends s to sb percent-encoded (bytes <= 0x20, >= 0x7f and '%'). */
void shardd__manifest_enc_name(shardd__sb *sb, const char *s);
/* Decodes s in place; returns 0 on a malformed escape or an escaped NUL. */
int shardd__manifest_dec_name(char *s);
/* The value of a lowercase hex digit, -1 for anything else. */
int shardd__manifest_hexval(char c);

typedef enum {
  SHARDD__LINE_OK,
  SHARDD__LINE_EOF,
  SHARDD__LINE_LONG,
  SHARDD__LINE_NUL,
  SHARDD__LINE_NOMEM,
  SHARDD__LINE_IO
} shardd__line_rc;

/* Reads the next line of f, without its newline, into *buf (the caller's,
 * grown with realloc to at most max + 1 bytes; free() it). */
shardd__line_rc shardd__manifest_read_line(FILE *f, char **buf, size_t *cap,
                                           size_t max);

/* Checks the seal of a manifest (the CRC32C on its "end" line) before any
 * line is acted upon, then rewinds f: SHARDD_E_INVAL with err naming path
 * and line when it does not match. *seal is the checked CRC and *end_line
 * the number of the line it was checked on; 0 when the manifest has no
 * such line (an unsealed version, or truncated: the parser says which).
 * A reader takes the manifest as sealed only when its own "end" line is
 * line *end_line: another line it reads as "end" (" end 0", say) was not
 * checked. */
shardd_err shardd__manifest_verify_seal(FILE *f, const char *path,
                                        uint32_t *seal, int *end_line,
                                        char *err, size_t errlen);

#endif /* SHARDD_MANIFEST_H */
