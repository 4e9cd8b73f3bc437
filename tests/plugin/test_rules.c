/* The C mirror of ncclwatch/rules.py against the shared vectors, plus the text helpers
 * (JSON escaping, UTF-8 repair, float formatting, safe file names).
 *
 * Usage: test_rules tests/vectors/rules.json [tests/vectors/job_id.json]
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "json.h"
#include "minijson.h"
#include "rules.h"

static int failures;
#define CHECK(cond, ...)                                  \
  do {                                                    \
    if (!(cond)) {                                        \
      fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                       \
      fputc('\n', stderr);                                \
      failures++;                                         \
    }                                                     \
  } while (0)

static char* read_file(const char* path, size_t* len) {
  FILE* f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  char* buf = malloc((size_t)n + 1);
  if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n) {
    fclose(f);
    free(buf);
    return NULL;
  }
  buf[n] = '\0';
  fclose(f);
  *len = (size_t)n;
  return buf;
}

static void test_vectors(const struct mj* v) {
  const struct mj* ids = mj_get(v, "record_id");
  CHECK(ids && ids->n >= 3, "record_id vectors present");
  for (size_t i = 0; ids && i < ids->n; i++) {
    const struct mj* x = &ids->items[i];
    char id[17];
    nw_record_id(mj_str(x, "job"), mj_str(x, "host"), (long)mj_int(x, "pid"), mj_str(x, "comm"),
                 (int)mj_int(x, "rank"), mj_str(x, "op"), (int)mj_int(x, "peer"),
                 (uint64_t)mj_int(x, "seq"), id);
    CHECK(strcmp(id, mj_str(x, "id")) == 0, "record_id[%zu] = %s, want %s", i, id, mj_str(x, "id"));
  }
  const struct mj* bw = mj_get(v, "bandwidth");
  CHECK(bw && bw->n >= 5, "bandwidth vectors present");
  for (size_t i = 0; bw && i < bw->n; i++) {
    const struct mj* x = &bw->items[i];
    double alg, bus;
    nw_bandwidths_gbs(mj_str(x, "op"), (uint64_t)mj_int(x, "bytes"), (int)mj_int(x, "nranks"),
                      mj_int(x, "exec_ns"), &alg, &bus);
    /* Bit-exact: the plugin and Python must print the same numbers. */
    CHECK(alg == mj_num(x, "algbw_gbs") && bus == mj_num(x, "busbw_gbs"),
          "bandwidth[%zu] %s: got (%.17g, %.17g) want (%.17g, %.17g)", i, mj_str(x, "op"), alg, bus,
          mj_num(x, "algbw_gbs"), mj_num(x, "busbw_gbs"));
  }
  const struct mj* sb = mj_get(v, "size_bucket");
  for (size_t i = 0; sb && i < sb->n; i++) {
    char out[32];
    nw_size_bucket((uint64_t)sb->items[i].items[0].i, out, sizeof out);
    CHECK(strcmp(out, sb->items[i].items[1].str) == 0, "size_bucket(%lld) = %s, want %s",
          (long long)sb->items[i].items[0].i, out, sb->items[i].items[1].str);
  }
  const struct mj* il = mj_get(v, "inspector_size_label");
  for (size_t i = 0; il && i < il->n; i++) {
    char out[32];
    nw_inspector_size_label((uint64_t)il->items[i].items[0].i, out, sizeof out);
    CHECK(strcmp(out, il->items[i].items[1].str) == 0, "inspector_size_label(%lld) = %s, want %s",
          (long long)il->items[i].items[0].i, out, il->items[i].items[1].str);
  }
  const struct mj* tc = mj_get(v, "transport_class");
  for (size_t i = 0; tc && i < tc->n; i++) {
    const char* t = nw_transport_class((int)tc->items[i].items[0].i, (int)tc->items[i].items[1].i);
    CHECK(t && strcmp(t, tc->items[i].items[2].str) == 0, "transport_class[%zu]", i);
  }
  CHECK(sb && il && tc, "all vector groups present");
}

static void test_rules_extra(void) {
  char out[NW_SAFE_NAME_MAX + 1];
  nw_safe_filename("../job 7/a.b", out);
  CHECK(strcmp(out, "%2E%2E%2Fjob%207%2Fa%2Eb") == 0, "safe_filename: %s", out);
  nw_safe_filename("", out);
  CHECK(strcmp(out, "%00") == 0, "safe_filename empty: %s", out);
  nw_safe_filename("\xc3\xbcnicode-ok_1", out);
  CHECK(strcmp(out, "%C3%BCnicode-ok_1") == 0, "safe_filename utf8: %s", out);
  char longname[300];
  memset(longname, '.', sizeof longname - 1);
  longname[sizeof longname - 1] = '\0';
  nw_safe_filename(longname, out);
  CHECK(strlen(out) == 128 && strncmp(out, "%2E%2E", 6) == 0 && out[126] == '%' && out[127] == '2',
        "safe_filename cut at 128 characters like Python: %s", out);
  CHECK(nw_local_ranks(16, 2) == 8 && nw_local_ranks(3, 2) == 2, "local_ranks");
  CHECK(nw_bus_factor("AllReduce", 8) == 1.75 && nw_bus_factor("AllToAll", 4) == 0.75 &&
            nw_bus_factor("AllReduce", 1) == 0.0 && nw_bus_factor("Send", 1) == 1.0,
        "bus_factor");
  CHECK(nw_dtype_bytes("ncclBfloat16") == 2 && nw_dtype_bytes("Unknown") == 0, "dtype bytes");
}

static void check_json_str(const char* in, const char* want_json, const char* want_decoded,
                           size_t want_len) {
  char* repaired = nw_utf8_repair(in, 1 << 20);
  char storage[512];
  struct nw_buf b;
  nw_buf_init(&b, storage, sizeof storage - 1);
  nw_json_str(&b, repaired);
  storage[b.len] = '\0';
  CHECK(strcmp(storage, want_json) == 0, "json_str: got %s want %s", storage, want_json);
  char err[128];
  struct mj* v = mj_parse(storage, b.len, err, sizeof err);
  CHECK(v && v->type == MJ_STR && v->str_len == want_len && memcmp(v->str, want_decoded, want_len) == 0,
        "json_str round trip of %s", want_json);
  mj_free(v);
  free(repaired);
}

static void test_text(void) {
  check_json_str("plain", "\"plain\"", "plain", 5);
  check_json_str("q\"b\\n\nt\tc\x01\x1f\x7f", "\"q\\\"b\\\\n\\nt\\tc\\u0001\\u001f\\u007f\"",
                 "q\"b\\n\nt\tc\x01\x1f\x7f", 12);
  /* Valid multi-byte UTF-8 passes unchanged; invalid bytes become U+FFFD per maximal
   * subpart, as Python's bytes.decode("utf-8", "replace") does. */
  check_json_str("\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80", "\"\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\"",
                 "\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80", 9);
  check_json_str("a\xffz", "\"a\xef\xbf\xbdz\"", "a\xef\xbf\xbdz", 5);
  check_json_str("\xe2\x82z", "\"\xef\xbf\xbdz\"", "\xef\xbf\xbdz", 4);          /* truncated */
  check_json_str("\xed\xa0\x80", "\"\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\"",      /* surrogate */
                 "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd", 9);
  check_json_str("\xc0\xaf", "\"\xef\xbf\xbd\xef\xbf\xbd\"", "\xef\xbf\xbd\xef\xbf\xbd", 6); /* overlong */
  check_json_str("\xf4\x90\x80\x80", "\"\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\"",
                 "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd", 12); /* > U+10FFFF */

  /* The cut never splits a character. */
  char* cut = nw_utf8_repair("ab\xe2\x82\xac", 4);
  CHECK(strcmp(cut, "ab") == 0, "repair cut: %s", cut);
  free(cut);

  static const double xs[] = {0.0, 1.0, 104.8576, 1.0 / 3.0, 1e-300, 123456789012345678.0, 0.1 + 0.2};
  for (size_t i = 0; i < sizeof xs / sizeof xs[0]; i++) {
    char storage[64];
    struct nw_buf b;
    nw_buf_init(&b, storage, sizeof storage - 1);
    nw_json_double(&b, xs[i]);
    storage[b.len] = '\0';
    CHECK(strtod(storage, NULL) == xs[i] && strpbrk(storage, ".e"), "json_double %s", storage);
  }
  char storage[64];
  struct nw_buf b;
  nw_buf_init(&b, storage, sizeof storage - 1);
  nw_json_double(&b, 104.8576);
  storage[b.len] = '\0';
  CHECK(strcmp(storage, "104.8576") == 0, "shortest repr: %s", storage);
  nw_buf_init(&b, storage, sizeof storage - 1);
  nw_json_double(&b, NAN);
  storage[b.len] = '\0';
  CHECK(strcmp(storage, "0.0") == 0, "nan -> 0.0: %s", storage);

  nw_buf_init(&b, storage, sizeof storage - 1);
  nw_prom_label(&b, "a\\b\"c\nd");
  storage[b.len] = '\0';
  CHECK(strcmp(storage, "a\\\\b\\\"c\\nd") == 0, "prom label: %s", storage);

  char small[4];
  nw_buf_init(&b, small, sizeof small);
  nw_buf_puts(&b, "hello");
  CHECK(b.overflow && b.len == 0, "buffer overflow is flagged, not written past");
}

/* Job identity (config.c) against the cases ncclwatch.ingest.throughput passes too. Each
 * case is the whole environment: every variable the rules read is cleared first. */
static void test_job_id(const struct mj* v) {
  static const char* const vars[] = {"NCCLWATCH_JOB_ID", "SLURM_JOB_ID", "PYTORCHJOB_NAME",
                                     "JOBSET_NAME", "VC_JOB_NAME", "K8S_JOB_NAME",
                                     "POD_NAMESPACE", "TORCHELASTIC_RUN_ID"};
  const struct mj* cases = mj_get(v, "cases");
  CHECK(cases && cases->n >= 10, "job_id cases present");
  for (size_t i = 0; cases && i < cases->n; i++) {
    const struct mj* c = &cases->items[i];
    for (size_t k = 0; k < sizeof vars / sizeof vars[0]; k++) unsetenv(vars[k]);
    const struct mj* env = mj_get(c, "env");
    for (size_t k = 0; env && k < env->n; k++) setenv(env->keys[k], env->items[k].str, 1);
    char job[256];
    const char* source = nw_config_job_id(job, sizeof job);
    const struct mj* want_source = mj_get(c, "source");
    CHECK(strcmp(job, mj_str(c, "job")) == 0, "job_id case %zu: %s, want %s", i, job, mj_str(c, "job"));
    if (want_source->type == MJ_NULL)
      CHECK(source == NULL, "job_id case %zu: source %s, want the fallback", i, source);
    else
      CHECK(source && strcmp(source, want_source->str) == 0, "job_id case %zu: source %s, want %s", i,
            source ? source : "(fallback)", want_source->str);
  }
  char small[8];
  setenv("NCCLWATCH_JOB_ID", "a-very-long-job-id", 1);
  nw_config_job_id(small, sizeof small);
  CHECK(strcmp(small, "a-very-") == 0, "a long job id is cut to the buffer: %s", small);
  unsetenv("NCCLWATCH_JOB_ID");
}

static struct mj* load_json(const char* path, char** text) {
  size_t len;
  *text = read_file(path, &len);
  if (!*text) {
    perror(path);
    return NULL;
  }
  char err[256];
  struct mj* v = mj_parse(*text, len, err, sizeof err);
  if (!v) fprintf(stderr, "%s: %s\n", path, err);
  return v;
}

int main(int argc, char** argv) {
  if (argc != 2 && argc != 3) {
    fprintf(stderr, "usage: %s rules.json [job_id.json]\n", argv[0]);
    return 2;
  }
  char* text;
  struct mj* v = load_json(argv[1], &text);
  if (!v) return 2;
  if (argc == 3) {
    char* job_text;
    struct mj* jv = load_json(argv[2], &job_text);
    if (!jv) return 2;
    test_job_id(jv);
    mj_free(jv);
    free(job_text);
  }
  test_vectors(v);
  test_rules_extra();
  test_text();
  mj_free(v);
  free(text);
  if (failures) {
    fprintf(stderr, "test_rules: %d failure(s)\n", failures);
    return 1;
  }
  printf("test_rules: ok\n");
  return 0;
}
