/* poison.h — what the bump allocators (the daemon's request arena, the
 * client's reply arena) tell AddressSanitizer: it sees malloc's blocks
 * only, so a chunk pieces are bumped out of would be one block to it, and
 * an overflow from one piece into the next, or a read of a piece after
 * its arena was taken back, would pass unseen. Under ASan a chunk's bytes
 * no piece holds are poisoned, each piece is followed by a poisoned
 * redzone, and what a rewind or reset takes back is poisoned again; the
 * allocators then run the same chunk code as a release build, so the
 * sanitizers and the fuzzer check that code too. Header-only; nothing
 * outside an ASan build. */
#ifndef SHARDD_POISON_H
#define SHARDD_POISON_H

#if defined(__SANITIZE_ADDRESS__)
#define SHARDD__ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SHARDD__ASAN 1
#endif
#endif

#ifdef SHARDD__ASAN
#include <sanitizer/asan_interface.h>
/* bytes kept poisoned after each piece (a piece's own rounding up to the
 * alignment is poisoned too, but is none for a size that is a multiple) */
#define SHARDD__REDZONE ((size_t)16)
#define SHARDD__POISON(p, n) ASAN_POISON_MEMORY_REGION((p), (n))
#define SHARDD__UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION((p), (n))
#else
#define SHARDD__REDZONE ((size_t)0)
#define SHARDD__POISON(p, n) ((void)(p), (void)(n))
#define SHARDD__UNPOISON(p, n) ((void)(p), (void)(n))
#endif

#endif /* SHARDD_POISON_H */
