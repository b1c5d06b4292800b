/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer: the metrics endpoint's HTTP request parser (daemon/http.c) on
 * arbitrary bytes, at most a request buffer's worth, as mokd feeds it.
 *
 * Invariants: a verdict is one of three; a refusal has a status the server
 * answers with and a reason; a served request has an absolute path within
 * the limits, HTTP/1.0 or 1.1, at most the header cap, and a head inside
 * the input that parses to the same verdict on its own; and the verdict on
 * a prefix is either "need more" or the verdict on the whole (bytes that
 * arrive later never change a judgement, so the server may stop reading).
 * The first input byte picks that prefix. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "http.h"

static void check_verdict(mok_http_verdict v, const mok_http_request *r, size_t len) {
  switch (v) {
  case MOK_HTTP_NEED_MORE:
    if (len >= MOK_HTTP_MAX_REQUEST) abort(); /* a full buffer is always judged */
    break;
  case MOK_HTTP_ERROR:
    if (!r->why || !r->why[0]) abort();
    switch (r->status) {
    case 400: case 405: case 413: case 414: case 431: case 505: break;
    default: abort();
    }
    break;
  case MOK_HTTP_DONE:
    if (r->head_bytes < 4 || r->head_bytes > len || r->head_bytes > MOK_HTTP_MAX_REQUEST) abort();
    if (r->path[0] != '/' || strlen(r->path) > MOK_HTTP_MAX_TARGET) abort();
    if (r->minor != 0 && r->minor != 1) abort();
    if (r->n_headers > MOK_HTTP_MAX_HEADERS) abort();
    break;
  default:
    abort();
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  uint8_t pick = data[0];
  data++, size--;
  if (size > MOK_HTTP_MAX_REQUEST) size = MOK_HTTP_MAX_REQUEST;
  /* a copy of exactly size bytes, so that ASan sees any read past it */
  char *buf = malloc(size ? size : 1);
  if (!buf) return 0;
  memcpy(buf, data, size);
  mok_http_request whole;
  mok_http_verdict v = mok_http_parse(buf, size, &whole);
  check_verdict(v, &whole, size);
  if (v == MOK_HTTP_DONE) {
    mok_http_request head;
    if (mok_http_parse(buf, whole.head_bytes, &head) != MOK_HTTP_DONE ||
        head.head_bytes != whole.head_bytes || strcmp(head.path, whole.path) != 0)
      abort();
  }
  size_t cut = (size_t)pick * size / 255;
  mok_http_request part;
  mok_http_verdict pv = mok_http_parse(buf, cut, &part);
  check_verdict(pv, &part, cut);
  if (pv != MOK_HTTP_NEED_MORE) {
    if (pv != v) abort();
    if (pv == MOK_HTTP_ERROR && part.status != whole.status) abort();
    if (pv == MOK_HTTP_DONE && part.head_bytes != whole.head_bytes) abort();
  }
  free(buf);
  return 0;
}
