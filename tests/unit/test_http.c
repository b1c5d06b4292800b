/* SPDX-License-Identifier: Apache-2.0 */
/* The metrics endpoint's HTTP request parser (daemon/http.c): what it
 * serves, everything it refuses and with which status, fed whole and byte
 * by byte. */
#include "harness/check.h"
#include "http.h"

static mok_http_verdict parse(const char *s, mok_http_request *r) {
  return mok_http_parse(s, strlen(s), r);
}

/* The verdict must not depend on how the bytes arrive: every prefix is
 * NEED_MORE or the same verdict, and the whole gives it. */
static void check_bytewise(const char *s, mok_http_verdict want, int status) {
  size_t n = strlen(s);
  mok_http_request r;
  for (size_t i = 1; i < n; i++) {
    mok_http_verdict v = mok_http_parse(s, i, &r);
    if (v == MOK_HTTP_NEED_MORE) continue;
    CHECK_MSG(v == want && (v != MOK_HTTP_ERROR || r.status == status),
              "prefix of %zu bytes of \"%s\": verdict %d status %d", i, s, v, r.status);
    return; /* judged early: the server stops reading here */
  }
  CHECK_EQ_INT(mok_http_parse(s, n, &r), want);
  if (want == MOK_HTTP_ERROR) CHECK_EQ_INT(r.status, status);
}

static void test_a_prometheus_scrape_is_served(void) {
  const char *req = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:9464\r\n"
                    "User-Agent: Prometheus/2.53.0\r\nAccept: text/plain;version=0.0.4;q=1\r\n"
                    "Accept-Encoding: gzip\r\nX-Prometheus-Scrape-Timeout-Seconds: 10\r\n\r\n";
  mok_http_request r;
  CHECK_EQ_INT(parse(req, &r), MOK_HTTP_DONE);
  CHECK(strcmp(r.path, "/metrics") == 0);
  CHECK_EQ_INT(r.minor, 1);
  CHECK_EQ_INT(r.n_headers, 5);
  CHECK_EQ_INT(r.head_bytes, strlen(req));
  check_bytewise(req, MOK_HTTP_DONE, 0);
  /* HTTP/1.0 needs no Host; the query is not part of the path */
  CHECK_EQ_INT(parse("GET /metrics?x=1&y HTTP/1.0\r\n\r\n", &r), MOK_HTTP_DONE);
  CHECK(strcmp(r.path, "/metrics") == 0);
  CHECK_EQ_INT(r.minor, 0);
  /* bytes after the head (a pipelined request) are left alone */
  CHECK_EQ_INT(parse("GET / HTTP/1.0\r\n\r\nGARBAGE", &r), MOK_HTTP_DONE);
  CHECK_EQ_INT(r.head_bytes, strlen("GET / HTTP/1.0\r\n\r\n"));
  CHECK(strcmp(r.path, "/") == 0);
  /* Content-Length: 0 is no body */
  CHECK_EQ_INT(parse("GET /metrics HTTP/1.1\r\nHost: h\r\nContent-Length: 0\r\n\r\n", &r),
               MOK_HTTP_DONE);
  /* header values may carry tabs, spaces and bytes past ASCII */
  CHECK_EQ_INT(parse("GET /metrics HTTP/1.1\r\nHost:h\r\nX-A: a\tb \xc3\xa9 \r\n\r\n", &r),
               MOK_HTTP_DONE);
}

static void test_incomplete_requests_need_more(void) {
  mok_http_request r;
  CHECK_EQ_INT(parse("", &r), MOK_HTTP_NEED_MORE);
  CHECK_EQ_INT(parse("GET /metrics HTTP/1.1\r", &r), MOK_HTTP_NEED_MORE);
  CHECK_EQ_INT(parse("GET /metrics HTTP/1.1\r\nHost: x\r\n", &r), MOK_HTTP_NEED_MORE);
  CHECK_EQ_INT(parse("GET /metrics HTTP/1.1\r\nHost: x\r\n\r", &r), MOK_HTTP_NEED_MORE);
}

static void test_methods_other_than_get_are_405(void) {
  const char *methods[] = {"POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH", "get", "CONNECT"};
  for (size_t i = 0; i < sizeof methods / sizeof methods[0]; i++) {
    char req[128];
    snprintf(req, sizeof req, "%s /metrics HTTP/1.1\r\nHost: x\r\n\r\n", methods[i]);
    mok_http_request r;
    CHECK_EQ_INT(parse(req, &r), MOK_HTTP_ERROR);
    CHECK_MSG(r.status == 405, "%s: %d", methods[i], r.status);
    check_bytewise(req, MOK_HTTP_ERROR, 405);
  }
}

static void test_malformed_requests_are_400(void) {
  const char *bad[] = {
      "GET  /metrics HTTP/1.1\r\nHost: x\r\n\r\n",         /* two spaces */
      "GET /metrics  HTTP/1.1\r\nHost: x\r\n\r\n",
      "GET /metrics HTTP/1.1 \r\nHost: x\r\n\r\n",         /* trailing space */
      " GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n",
      "GET metrics HTTP/1.1\r\nHost: x\r\n\r\n",           /* not an absolute path */
      "GET http://x/metrics HTTP/1.1\r\nHost: x\r\n\r\n",  /* absolute form */
      "GET * HTTP/1.1\r\nHost: x\r\n\r\n",
      "GET /metrics\r\n\r\n",                              /* HTTP/0.9 */
      "GET /metrics HTTP/1.1\nHost: x\n\n",                /* bare LF */
      "GET /metrics HTTP/1.1\r\nHost: x\n\r\n",
      "GET /metrics HTTP/1.1\rHost: x\r\n\r\n",            /* bare CR */
      "GET /metrics HTTP/1.1\r\n\r\n",                     /* 1.1 without Host */
      "GET /metrics HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
      "GET /metrics HTTP/1.1\r\nHost : x\r\n\r\n",         /* space before the colon */
      "GET /metrics HTTP/1.1\r\nHost: x\r\n folded\r\n\r\n",
      "GET /metrics HTTP/1.1\r\nHost: x\r\n\tfolded\r\n\r\n",
      "GET /metrics HTTP/1.1\r\nHost: x\r\nNoColon\r\n\r\n",
      "GET /metrics HTTP/1.1\r\nHost: x\r\n: empty name\r\n\r\n",
      "GET /metrics HTTP/1.1\r\nHost: x\r\nX-A: a\x01b\r\n\r\n",
      "GET /metrics HTTP/1.1\r\nHost: x\r\nX-A: a\x7f\r\n\r\n",
      "GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello",
      "GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: -0\r\n\r\n",
      "GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length:\r\n\r\n",
      "GET /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
      "GET /metrics HTTP/1.x\r\nHost: x\r\n\r\n",
      "GET /metrics HTTP/11\r\nHost: x\r\n\r\n",
      "GET /metrics http/1.1\r\nHost: x\r\n\r\n",
      "GET /met\x01rics HTTP/1.1\r\nHost: x\r\n\r\n",
      "\r\nGET /metrics HTTP/1.1\r\nHost: x\r\n\r\n",       /* leading empty line */
      "\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",      /* a TLS ClientHello */
      "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA\r\n\r\n",
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    mok_http_request r;
    size_t n = strlen(bad[i]);
    if (i == 29) n = 11; /* the ClientHello has a NUL */
    mok_http_verdict v = mok_http_parse(bad[i], n, &r);
    CHECK_MSG(v == MOK_HTTP_ERROR && r.status == 400, "case %zu: verdict %d status %d", i, v,
              r.status);
    CHECK(r.why != NULL && r.why[0]);
    if (i != 29) check_bytewise(bad[i], MOK_HTTP_ERROR, 400);
  }
  /* a NUL anywhere */
  const char nul[] = "GET /metrics HTTP/1.1\r\nHost: x\0\r\n\r\n";
  mok_http_request r;
  CHECK_EQ_INT(mok_http_parse(nul, sizeof nul - 1, &r), MOK_HTTP_ERROR);
  CHECK_EQ_INT(r.status, 400);
}

static void test_garbage_is_refused_before_the_request_could_end(void) {
  /* a complete first line is judged at once, headers yet to come */
  mok_http_request r;
  CHECK_EQ_INT(parse("BLAH BLAH BLAH\r\n", &r), MOK_HTTP_ERROR);
  CHECK_EQ_INT(r.status, 400);
  CHECK_EQ_INT(parse("POST /metrics HTTP/1.1\r\n", &r), MOK_HTTP_ERROR);
  CHECK_EQ_INT(r.status, 405);
  /* a bare LF is refused on sight */
  CHECK_EQ_INT(parse("GET\n", &r), MOK_HTTP_ERROR);
}

static void test_other_versions_are_505(void) {
  const char *v[] = {"HTTP/2.0", "HTTP/1.2", "HTTP/0.9", "HTTP/3.0"};
  for (size_t i = 0; i < 4; i++) {
    char req[96];
    snprintf(req, sizeof req, "GET /metrics %s\r\nHost: x\r\n\r\n", v[i]);
    mok_http_request r;
    CHECK_EQ_INT(parse(req, &r), MOK_HTTP_ERROR);
    CHECK_EQ_INT(r.status, 505);
  }
}

static void test_oversized_requests_are_refused(void) {
  static char big[2 * MOK_HTTP_MAX_REQUEST];
  mok_http_request r;
  /* a long target: 414 */
  int n = snprintf(big, sizeof big, "GET /%0*d HTTP/1.1\r\nHost: x\r\n\r\n", MOK_HTTP_MAX_TARGET,
                   0);
  CHECK_EQ_INT(mok_http_parse(big, (size_t)n, &r), MOK_HTTP_ERROR);
  CHECK_EQ_INT(r.status, 414);
  /* ...also when it never ends */
  memset(big, 'a', sizeof big);
  memcpy(big, "GET /", 5);
  CHECK_EQ_INT(mok_http_parse(big, 600, &r), MOK_HTTP_ERROR);
  CHECK_EQ_INT(r.status, 414);
  /* the longest target still fits */
  n = snprintf(big, sizeof big, "GET /%0*d HTTP/1.1\r\nHost: x\r\n\r\n", MOK_HTTP_MAX_TARGET - 1,
               0);
  CHECK_EQ_INT(mok_http_parse(big, (size_t)n, &r), MOK_HTTP_DONE);
  /* a head past the cap: 413, whether it ends or not */
  size_t len = (size_t)snprintf(big, sizeof big, "GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: ");
  while (len < MOK_HTTP_MAX_REQUEST) big[len++] = 'b';
  CHECK_EQ_INT(mok_http_parse(big, MOK_HTTP_MAX_REQUEST, &r), MOK_HTTP_ERROR);
  CHECK_EQ_INT(r.status, 413);
  memcpy(big + MOK_HTTP_MAX_REQUEST - 6, "\r\n\r\n", 4);
  CHECK_EQ_INT(mok_http_parse(big, MOK_HTTP_MAX_REQUEST - 2, &r), MOK_HTTP_DONE);
  memcpy(big + MOK_HTTP_MAX_REQUEST - 6, "bb\r\n\r\n", 6);
  CHECK_EQ_INT(mok_http_parse(big, MOK_HTTP_MAX_REQUEST, &r), MOK_HTTP_DONE); /* exactly the cap */
  memcpy(big + MOK_HTTP_MAX_REQUEST - 6, "bbb\r\n\r", 6);
  big[MOK_HTTP_MAX_REQUEST] = '\n';
  CHECK_EQ_INT(mok_http_parse(big, MOK_HTTP_MAX_REQUEST + 1, &r), MOK_HTTP_ERROR);
  CHECK_EQ_INT(r.status, 413);
}

static void test_too_many_headers_are_431(void) {
  char req[4096];
  size_t n = (size_t)snprintf(req, sizeof req, "GET /metrics HTTP/1.1\r\nHost: x\r\n");
  for (int i = 1; i < MOK_HTTP_MAX_HEADERS; i++)
    n += (size_t)snprintf(req + n, sizeof req - n, "X-%d: y\r\n", i);
  snprintf(req + n, sizeof req - n, "\r\n");
  mok_http_request r;
  CHECK_EQ_INT(parse(req, &r), MOK_HTTP_DONE); /* exactly the cap */
  CHECK_EQ_INT(r.n_headers, MOK_HTTP_MAX_HEADERS);
  snprintf(req + n, sizeof req - n, "X-last: y\r\n");
  CHECK_EQ_INT(parse(req, &r), MOK_HTTP_ERROR); /* judged before the blank line */
  CHECK_EQ_INT(r.status, 431);
}

static void test_response_heads(void) {
  char buf[512];
  size_t n = mok_http_response_head(buf, sizeof buf, 200, "text/plain; version=0.0.4", 1234);
  CHECK(n > 0 && n == strlen(buf));
  CHECK(strncmp(buf, "HTTP/1.1 200 OK\r\n", 17) == 0);
  CHECK_STR_CONTAINS(buf, "Content-Length: 1234\r\n");
  CHECK_STR_CONTAINS(buf, "Connection: close\r\n");
  CHECK(strcmp(buf + n - 4, "\r\n\r\n") == 0);
  CHECK(strstr(buf, "Allow:") == NULL);
  n = mok_http_response_head(buf, sizeof buf, 405, "text/plain", 0);
  CHECK_STR_CONTAINS(buf, "HTTP/1.1 405 Method Not Allowed\r\n");
  CHECK_STR_CONTAINS(buf, "Allow: GET\r\n");
  CHECK_EQ_INT(mok_http_response_head(buf, 20, 200, "text/plain", 0), 0); /* too small */
}

static const check_case cases[] = {CHECK_CASE(test_a_prometheus_scrape_is_served),
                                   CHECK_CASE(test_incomplete_requests_need_more),
                                   CHECK_CASE(test_methods_other_than_get_are_405),
                                   CHECK_CASE(test_malformed_requests_are_400),
                                   CHECK_CASE(test_garbage_is_refused_before_the_request_could_end),
                                   CHECK_CASE(test_other_versions_are_505),
                                   CHECK_CASE(test_oversized_requests_are_refused),
                                   CHECK_CASE(test_too_many_headers_are_431),
                                   CHECK_CASE(test_response_heads),
                                   {0}};

int main(int argc, char **argv) { return check_main(argc, argv, cases); }
