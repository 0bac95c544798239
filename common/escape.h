/* escape.h — (shared by daemon and shardctl) the one escape of bytes others
 * chose (job, buffer, view and optimizer names, paths, messages quoting
 * them) for a line of text: the daemon's log lines and shardctl's text
 * reports. A name is any bytes but NUL, so a control byte in one would end
 * the line and forge one of its own, or drive an operator's terminal. */
#ifndef SHARDD_ESCAPE_H
#define SHARDD_ESCAPE_H

#include <stddef.h>

/* in (NULL reads as "") into out (outlen bytes, NUL-terminated), each
 * control byte (below 0x20, and 0x7f) as \xNN, each C1 control written in
 * UTF-8 (c2 80..c2 9f, which UTF-8 terminals obey too) as its two bytes
 * \xc2\xNN, and each backslash as \\, so the escape is unambiguous. 4 * strlen(in) + 1 bytes always suffice;
 * where out is smaller and in does not fit, it is cut before a character
 * that does not fit whole, never inside an escape, and ends in "..." (an
 * outlen below 4 gets ""). Returns out, for a printf argument. */
const char *shardd__escape(const char *in, char *out, size_t outlen);

/* The bytes of the UTF-8 character p starts (1 to 4: U+0000 to U+10FFFF in
 * its shortest form, no surrogate), or 0 where p starts none: a byte that
 * only continues a character, one that starts no form (c0, c1, f5..ff), an
 * overlong form, a surrogate (U+D800..U+DFFF), past U+10FFFF, or a
 * character cut short (by the NUL too, so a read never passes it). JSON
 * text must be UTF-8 (RFC 8259): shardd__sb_json_str writes what starts
 * none as \ufffd (see shardd__utf8_bad_len). */
size_t shardd__utf8_len(const char *p);

/* Where shardd__utf8_len(p) is 0: the bytes one U+FFFD stands for, as a
 * UTF-8 decoder's "replace" (Python's, WHATWG's) takes them: the longest
 * start of a character p has (a character cut short, "\xe2\x82", is one),
 * else p's one byte. 1 to 3; nothing past a NUL is read. */
size_t shardd__utf8_bad_len(const char *p);

#endif /* SHARDD_ESCAPE_H */
