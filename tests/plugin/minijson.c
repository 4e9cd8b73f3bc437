#include "minijson.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct mj_p {
  const char* s;
  size_t len, pos;
  char* err;
  size_t err_len;
  int depth;
};

static bool mj_fail(struct mj_p* p, const char* msg) {
  if (p->err && p->err_len) snprintf(p->err, p->err_len, "%s at offset %zu", msg, p->pos);
  return false;
}

static void mj_ws(struct mj_p* p) {
  while (p->pos < p->len && (p->s[p->pos] == ' ' || p->s[p->pos] == '\t' ||
                             p->s[p->pos] == '\n' || p->s[p->pos] == '\r'))
    p->pos++;
}

static bool mj_value(struct mj_p* p, struct mj* out);
static void mj_free_inner(struct mj* v);

static void mj_put_utf8(char* out, size_t* o, uint32_t cp) {
  if (cp < 0x80) out[(*o)++] = (char)cp;
  else if (cp < 0x800) {
    out[(*o)++] = (char)(0xc0 | (cp >> 6));
    out[(*o)++] = (char)(0x80 | (cp & 0x3f));
  } else if (cp < 0x10000) {
    out[(*o)++] = (char)(0xe0 | (cp >> 12));
    out[(*o)++] = (char)(0x80 | ((cp >> 6) & 0x3f));
    out[(*o)++] = (char)(0x80 | (cp & 0x3f));
  } else {
    out[(*o)++] = (char)(0xf0 | (cp >> 18));
    out[(*o)++] = (char)(0x80 | ((cp >> 12) & 0x3f));
    out[(*o)++] = (char)(0x80 | ((cp >> 6) & 0x3f));
    out[(*o)++] = (char)(0x80 | (cp & 0x3f));
  }
}

static bool mj_hex4(struct mj_p* p, uint32_t* v) {
  if (p->pos + 4 > p->len) return mj_fail(p, "short \\u escape");
  *v = 0;
  for (int i = 0; i < 4; i++) {
    char c = p->s[p->pos++];
    *v <<= 4;
    if (c >= '0' && c <= '9') *v |= (uint32_t)(c - '0');
    else if (c >= 'a' && c <= 'f') *v |= (uint32_t)(c - 'a' + 10);
    else if (c >= 'A' && c <= 'F') *v |= (uint32_t)(c - 'A' + 10);
    else return mj_fail(p, "bad hex digit");
  }
  return true;
}

static bool mj_string(struct mj_p* p, char** out, size_t* out_len) {
  p->pos++; /* opening quote */
  size_t start = p->pos;
  char* buf = malloc(p->len - start + 4);
  if (!buf) return mj_fail(p, "oom");
  size_t o = 0;
  while (p->pos < p->len) {
    unsigned char c = (unsigned char)p->s[p->pos];
    if (c == '"') {
      p->pos++;
      buf[o] = '\0';
      *out = buf;
      *out_len = o;
      return true;
    }
    if (c < 0x20) {
      free(buf);
      return mj_fail(p, "raw control character in string");
    }
    if (c != '\\') {
      buf[o++] = (char)c;
      p->pos++;
      continue;
    }
    p->pos++;
    if (p->pos >= p->len) break;
    char e = p->s[p->pos++];
    switch (e) {
      case '"': buf[o++] = '"'; break;
      case '\\': buf[o++] = '\\'; break;
      case '/': buf[o++] = '/'; break;
      case 'b': buf[o++] = '\b'; break;
      case 'f': buf[o++] = '\f'; break;
      case 'n': buf[o++] = '\n'; break;
      case 'r': buf[o++] = '\r'; break;
      case 't': buf[o++] = '\t'; break;
      case 'u': {
        uint32_t cp;
        if (!mj_hex4(p, &cp)) {
          free(buf);
          return false;
        }
        if (cp >= 0xd800 && cp < 0xdc00 && p->pos + 6 <= p->len && p->s[p->pos] == '\\' &&
            p->s[p->pos + 1] == 'u') {
          uint32_t lo;
          p->pos += 2;
          if (!mj_hex4(p, &lo)) {
            free(buf);
            return false;
          }
          cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
        }
        mj_put_utf8(buf, &o, cp);
        break;
      }
      default: free(buf); return mj_fail(p, "bad escape");
    }
  }
  free(buf);
  return mj_fail(p, "unterminated string");
}

static bool mj_number(struct mj_p* p, struct mj* out) {
  size_t start = p->pos;
  bool is_int = true;
  if (p->s[p->pos] == '-') p->pos++;
  while (p->pos < p->len) {
    char c = p->s[p->pos];
    if (c >= '0' && c <= '9') p->pos++;
    else if (c == '.' || c == 'e' || c == 'E' || c == '+' || c == '-') {
      is_int = false;
      p->pos++;
    } else break;
  }
  char tmp[64];
  size_t n = p->pos - start;
  if (n == 0 || n >= sizeof tmp) return mj_fail(p, "bad number");
  memcpy(tmp, p->s + start, n);
  tmp[n] = '\0';
  char* end;
  out->type = MJ_NUM;
  out->is_int = is_int;
  out->num = strtod(tmp, &end);
  if (*end) return mj_fail(p, "bad number");
  if (is_int) out->i = strtoll(tmp, NULL, 10);
  return true;
}

static bool mj_lit(struct mj_p* p, const char* lit) {
  size_t n = strlen(lit);
  if (p->pos + n > p->len || memcmp(p->s + p->pos, lit, n) != 0) return mj_fail(p, "bad literal");
  p->pos += n;
  return true;
}

static bool mj_push(struct mj* v, char* key, struct mj* item) {
  struct mj* items = realloc(v->items, (v->n + 1) * sizeof *items);
  if (!items) return false;
  v->items = items;
  v->items[v->n] = *item;
  if (v->type == MJ_OBJ) {
    char** keys = realloc(v->keys, (v->n + 1) * sizeof *keys);
    if (!keys) return false;
    v->keys = keys;
    v->keys[v->n] = key;
  }
  v->n++;
  return true;
}

static bool mj_value(struct mj_p* p, struct mj* out) {
  memset(out, 0, sizeof *out);
  mj_ws(p);
  if (p->pos >= p->len) return mj_fail(p, "unexpected end");
  if (++p->depth > 64) return mj_fail(p, "too deep");
  char c = p->s[p->pos];
  bool ok = true;
  if (c == '{' || c == '[') {
    out->type = c == '{' ? MJ_OBJ : MJ_ARR;
    p->pos++;
    mj_ws(p);
    if (p->pos < p->len && p->s[p->pos] == (c == '{' ? '}' : ']')) {
      p->pos++;
    } else {
      for (;;) {
        char* key = NULL;
        size_t key_len;
        mj_ws(p);
        if (out->type == MJ_OBJ) {
          if (p->pos >= p->len || p->s[p->pos] != '"' || !mj_string(p, &key, &key_len)) {
            ok = ok && mj_fail(p, "expected key");
            break;
          }
          mj_ws(p);
          if (p->pos >= p->len || p->s[p->pos] != ':') {
            free(key);
            ok = mj_fail(p, "expected ':'");
            break;
          }
          p->pos++;
        }
        struct mj item;
        if (!mj_value(p, &item)) {
          free(key);
          mj_free_inner(&item);
          ok = false;
          break;
        }
        mj_push(out, key, &item);
        mj_ws(p);
        if (p->pos < p->len && p->s[p->pos] == ',') {
          p->pos++;
          continue;
        }
        if (p->pos < p->len && p->s[p->pos] == (c == '{' ? '}' : ']')) {
          p->pos++;
          break;
        }
        ok = mj_fail(p, "expected ',' or end");
        break;
      }
    }
  } else if (c == '"') {
    out->type = MJ_STR;
    ok = mj_string(p, &out->str, &out->str_len);
  } else if (c == 't') {
    out->type = MJ_BOOL;
    out->b = true;
    ok = mj_lit(p, "true");
  } else if (c == 'f') {
    out->type = MJ_BOOL;
    ok = mj_lit(p, "false");
  } else if (c == 'n') {
    ok = mj_lit(p, "null");
  } else {
    ok = mj_number(p, out);
  }
  p->depth--;
  return ok;
}

static void mj_free_inner(struct mj* v) {
  free(v->str);
  for (size_t i = 0; i < v->n; i++) {
    mj_free_inner(&v->items[i]);
    if (v->keys) free(v->keys[i]);
  }
  free(v->items);
  free(v->keys);
}

void mj_free(struct mj* v) {
  if (!v) return;
  mj_free_inner(v);
  free(v);
}

struct mj* mj_parse(const char* text, size_t len, char* err, size_t err_len) {
  struct mj_p p = {text, len, 0, err, err_len, 0};
  struct mj* v = calloc(1, sizeof *v);
  if (!v) return NULL;
  if (!mj_value(&p, v)) {
    mj_free(v);
    return NULL;
  }
  mj_ws(&p);
  if (p.pos != len) {
    mj_fail(&p, "trailing data");
    mj_free(v);
    return NULL;
  }
  return v;
}

const struct mj* mj_get(const struct mj* obj, const char* key) {
  if (!obj || obj->type != MJ_OBJ) return NULL;
  for (size_t i = 0; i < obj->n; i++)
    if (strcmp(obj->keys[i], key) == 0) return &obj->items[i];
  return NULL;
}

static const struct mj* mj_need(const struct mj* obj, const char* key, enum mj_type t) {
  const struct mj* v = mj_get(obj, key);
  if (!v || v->type != t) {
    fprintf(stderr, "minijson: field \"%s\" missing or of the wrong type\n", key);
    abort();
  }
  return v;
}

const char* mj_str(const struct mj* obj, const char* key) { return mj_need(obj, key, MJ_STR)->str; }
int64_t mj_int(const struct mj* obj, const char* key) {
  const struct mj* v = mj_need(obj, key, MJ_NUM);
  if (!v->is_int) {
    fprintf(stderr, "minijson: field \"%s\" is not an integer\n", key);
    abort();
  }
  return v->i;
}
double mj_num(const struct mj* obj, const char* key) { return mj_need(obj, key, MJ_NUM)->num; }
bool mj_bool(const struct mj* obj, const char* key) { return mj_need(obj, key, MJ_BOOL)->b; }
