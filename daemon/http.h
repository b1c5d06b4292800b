/* SPDX-License-Identifier: Apache-2.0 */
/* A tiny, strict HTTP/1.0 and 1.1 request parser for mokd's /metrics
 * endpoint (docs/metrics.md). Pure: no I/O, no allocation, bounded work.
 *
 * Only GET with no body is served, one request per connection. Everything
 * the parser does not understand is refused with the status to answer:
 *
 *   400  malformed (bare LF or CR, NUL, whitespace before a header's colon,
 *        folded headers, a bad token, a body, a missing or repeated Host)
 *   405  a well-formed method other than GET
 *   413  the request head is larger than MOK_HTTP_MAX_REQUEST
 *   414  the target is longer than MOK_HTTP_MAX_TARGET
 *   431  more than MOK_HTTP_MAX_HEADERS header lines
 *   505  an HTTP version other than 1.0 or 1.1
 *
 * The parser is called again with the whole buffer each time more bytes
 * arrive (the buffer never exceeds MOK_HTTP_MAX_REQUEST); it judges every
 * complete line as soon as it is there, so garbage is refused at once
 * rather than when the connection times out.
 */
#ifndef MOK_HTTP_H
#define MOK_HTTP_H

#include <stddef.h>

#define MOK_HTTP_MAX_REQUEST 4096 /* bytes of request line and headers */
#define MOK_HTTP_MAX_HEADERS 32
#define MOK_HTTP_MAX_TARGET 256

typedef enum mok_http_verdict {
  MOK_HTTP_ERROR = -1,    /* refuse with req->status, then close */
  MOK_HTTP_NEED_MORE = 0, /* no complete request yet */
  MOK_HTTP_DONE = 1,      /* a complete GET: req->path */
} mok_http_verdict;

typedef struct mok_http_request {
  int status;        /* MOK_HTTP_ERROR: the status to answer */
  const char *why;   /* MOK_HTTP_ERROR: a short reason (static text) */
  int minor;         /* HTTP/1.minor (0 or 1) once the request line is in */
  unsigned n_headers;
  size_t head_bytes; /* MOK_HTTP_DONE: bytes through the blank line */
  char path[MOK_HTTP_MAX_TARGET + 1]; /* the target without its query */
} mok_http_request;

/* Judge the bytes received so far (buf[0..len)). */
mok_http_verdict mok_http_parse(const char *buf, size_t len, mok_http_request *req);

/* The reason phrase of a status this server answers with ("" if none). */
const char *mok_http_reason(int status);

/* Format a response head (HTTP/1.1, Connection: close, Content-Length:
 * body_len; 405 adds Allow: GET) into buf. Returns its length, or 0 when
 * cap is too small. */
size_t mok_http_response_head(char *buf, size_t cap, int status, const char *content_type,
                              size_t body_len);

#endif
