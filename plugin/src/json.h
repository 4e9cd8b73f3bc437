/* Text output helpers for the writer thread: a bounded byte buffer, JSON string escaping,
 * shortest round-trip doubles, Prometheus label escaping, UTF-8 repair. */
#ifndef NW_JSON_H
#define NW_JSON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct nw_buf {
  char* data;
  size_t len;
  size_t cap;
  bool overflow; /* an append did not fit: the content is incomplete */
};

void nw_buf_init(struct nw_buf* b, char* storage, size_t cap);
void nw_buf_reset(struct nw_buf* b);
void nw_buf_put(struct nw_buf* b, const char* s, size_t n);
void nw_buf_puts(struct nw_buf* b, const char* s);
void nw_buf_printf(struct nw_buf* b, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
void nw_buf_i64(struct nw_buf* b, int64_t v);
void nw_buf_u64(struct nw_buf* b, uint64_t v);

/* A JSON string literal (with quotes) of valid UTF-8 s: escapes '"', '\\' and every
 * control character. Callers pass strings already repaired by nw_utf8_repair. */
void nw_json_str(struct nw_buf* b, const char* s);
/* A JSON number that parses back to exactly x (shortest of %.15g/%.16g/%.17g), always
 * with a '.' or exponent so readers see a float; 0.0 for NaN or infinities. */
void nw_json_double(struct nw_buf* b, double x);
/* A Prometheus label value (without quotes): escapes '\\', '"' and newline. */
void nw_prom_label(struct nw_buf* b, const char* s);

/* Copy at most max_bytes of s into a new malloc'd string of valid UTF-8: each maximal
 * invalid subsequence becomes U+FFFD (as Python's errors="replace"), and the cut never
 * splits a character. NULL s gives "". Returns NULL only when malloc fails. */
char* nw_utf8_repair(const char* s, size_t max_bytes);

#endif
