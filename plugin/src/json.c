#include "json.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void nw_buf_init(struct nw_buf* b, char* storage, size_t cap) {
  b->data = storage;
  b->cap = cap;
  b->len = 0;
  b->overflow = false;
}

void nw_buf_reset(struct nw_buf* b) {
  b->len = 0;
  b->overflow = false;
}

void nw_buf_put(struct nw_buf* b, const char* s, size_t n) {
  if (b->overflow || n > b->cap - b->len) {
    b->overflow = true;
    return;
  }
  memcpy(b->data + b->len, s, n);
  b->len += n;
}

void nw_buf_puts(struct nw_buf* b, const char* s) { nw_buf_put(b, s, strlen(s)); }

void nw_buf_printf(struct nw_buf* b, const char* fmt, ...) {
  if (b->overflow) return;
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(b->data + b->len, b->cap - b->len, fmt, ap);
  va_end(ap);
  if (n < 0 || (size_t)n >= b->cap - b->len) {
    b->overflow = true;
    return;
  }
  b->len += (size_t)n;
}

void nw_buf_i64(struct nw_buf* b, int64_t v) { nw_buf_printf(b, "%lld", (long long)v); }
void nw_buf_u64(struct nw_buf* b, uint64_t v) { nw_buf_printf(b, "%llu", (unsigned long long)v); }

void nw_json_str(struct nw_buf* b, const char* s) {
  static const char hex[] = "0123456789abcdef";
  nw_buf_put(b, "\"", 1);
  const char* run = s;
  for (const char* p = s;; p++) {
    unsigned char c = (unsigned char)*p;
    if (c != 0 && c >= 0x20 && c != '"' && c != '\\' && c != 0x7f) continue;
    nw_buf_put(b, run, (size_t)(p - run));
    if (c == 0) break;
    switch (c) {
      case '"': nw_buf_put(b, "\\\"", 2); break;
      case '\\': nw_buf_put(b, "\\\\", 2); break;
      case '\n': nw_buf_put(b, "\\n", 2); break;
      case '\r': nw_buf_put(b, "\\r", 2); break;
      case '\t': nw_buf_put(b, "\\t", 2); break;
      case '\b': nw_buf_put(b, "\\b", 2); break;
      case '\f': nw_buf_put(b, "\\f", 2); break;
      default: {
        const char esc[6] = {'\\', 'u', '0', '0', hex[c >> 4], hex[c & 15]};
        nw_buf_put(b, esc, 6);
      }
    }
    run = p + 1;
  }
  nw_buf_put(b, "\"", 1);
}

void nw_json_double(struct nw_buf* b, double x) {
  char tmp[40];
  if (!isfinite(x)) x = 0.0;
  for (int prec = 15; prec <= 17; prec++) {
    snprintf(tmp, sizeof tmp, "%.*g", prec, x);
    if (prec == 17 || strtod(tmp, NULL) == x) break;
  }
  nw_buf_puts(b, tmp);
  if (!strpbrk(tmp, ".eEn")) nw_buf_put(b, ".0", 2);
}

void nw_prom_label(struct nw_buf* b, const char* s) {
  const char* run = s;
  for (const char* p = s;; p++) {
    char c = *p;
    if (c != 0 && c != '\\' && c != '"' && c != '\n') continue;
    nw_buf_put(b, run, (size_t)(p - run));
    if (c == 0) break;
    nw_buf_put(b, c == '\\' ? "\\\\" : c == '"' ? "\\\"" : "\\n", 2);
    run = p + 1;
  }
}

/* Length of the valid UTF-8 sequence at p (1..4), or 0 when the bytes at p start an
 * invalid one; *bad gets the length of the maximal invalid subpart in that case
 * (Unicode's "substitution of maximal subparts", which Python follows). */
static size_t nw_utf8_seq(const unsigned char* p, size_t avail, size_t* bad) {
  unsigned char c = p[0];
  size_t need;
  unsigned char lo = 0x80, hi = 0xbf; /* allowed range of the second byte */
  if (c < 0x80) return 1;
  if (c >= 0xc2 && c <= 0xdf) need = 2;
  else if (c == 0xe0) { need = 3; lo = 0xa0; }
  else if (c == 0xed) { need = 3; hi = 0x9f; } /* no UTF-16 surrogates */
  else if (c >= 0xe1 && c <= 0xef) need = 3;
  else if (c == 0xf0) { need = 4; lo = 0x90; }
  else if (c == 0xf4) { need = 4; hi = 0x8f; } /* nothing above U+10FFFF */
  else if (c >= 0xf1 && c <= 0xf3) need = 4;
  else { *bad = 1; return 0; }
  size_t i = 1;
  for (; i < need; i++) {
    if (i >= avail) break;
    unsigned char lo_i = i == 1 ? lo : 0x80, hi_i = i == 1 ? hi : 0xbf;
    if (p[i] < lo_i || p[i] > hi_i) break;
  }
  if (i == need) return need;
  *bad = i;
  return 0;
}

char* nw_utf8_repair(const char* s, size_t max_bytes) {
  if (!s) s = "";
  size_t n = strnlen(s, max_bytes * 4 + 4);
  /* Worst case every byte becomes the 3-byte U+FFFD. */
  char* out = malloc(3 * n + 1);
  if (!out) return NULL;
  const unsigned char* p = (const unsigned char*)s;
  size_t o = 0;
  for (size_t i = 0; i < n;) {
    size_t bad = 0, len = nw_utf8_seq(p + i, n - i, &bad);
    const char* piece = (const char*)p + i;
    size_t piece_len = len;
    if (len == 0) {
      piece = "\xef\xbf\xbd";
      piece_len = 3;
      len = bad;
    }
    if (o + piece_len > max_bytes) break;
    memcpy(out + o, piece, piece_len);
    o += piece_len;
    i += len;
  }
  out[o] = '\0';
  return out;
}
