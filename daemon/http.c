/* SPDX-License-Identifier: Apache-2.0 */
#include "http.h"

#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

/* method SP target SP "HTTP/x.y": the longest request line worth reading */
#define METHOD_MAX 16
#define REQUEST_LINE_MAX (METHOD_MAX + 1 + MOK_HTTP_MAX_TARGET + 1 + 8)

static mok_http_verdict refuse(mok_http_request *req, int status, const char *why) {
  req->status = status;
  req->why = why;
  return MOK_HTTP_ERROR;
}

/* RFC 9110 tchar */
static bool is_tchar(unsigned char c) {
  if ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) return true;
  return c && strchr("!#$%&'*+-.^_`|~", c) != NULL;
}

static bool is_vchar(unsigned char c) { return c >= 0x21 && c <= 0x7e; }

/* "HTTP/" DIGIT "." DIGIT: 1 with *minor for 1.0 and 1.1, 0 for another
 * version, -1 when it is not a version at all. */
static int parse_version(const char *v, size_t n, int *minor) {
  if (n != 8 || memcmp(v, "HTTP/", 5) != 0 || v[6] != '.') return -1;
  if (v[5] < '0' || v[5] > '9' || v[7] < '0' || v[7] > '9') return -1;
  if (v[5] != '1' || (v[7] != '0' && v[7] != '1')) return 0;
  *minor = v[7] - '0';
  return 1;
}

static mok_http_verdict parse_request_line(const char *l, size_t n, mok_http_request *req) {
  size_t m = 0;
  while (m < n && is_tchar((unsigned char)l[m])) m++;
  if (m == 0 || m >= n || l[m] != ' ') return refuse(req, 400, "malformed request line");
  if (m > METHOD_MAX) return refuse(req, 400, "method too long");
  size_t t0 = m + 1, t = t0;
  while (t < n && is_vchar((unsigned char)l[t])) t++;
  if (t == t0 || t >= n || l[t] != ' ') return refuse(req, 400, "malformed request line");
  if (t - t0 > MOK_HTTP_MAX_TARGET) return refuse(req, 414, "request target too long");
  if (l[t0] != '/') return refuse(req, 400, "the target must be an absolute path");
  int v = parse_version(l + t + 1, n - t - 1, &req->minor);
  if (v < 0) return refuse(req, 400, "malformed HTTP version");
  if (v == 0) return refuse(req, 505, "only HTTP/1.0 and HTTP/1.1 are served");
  if (m != 3 || memcmp(l, "GET", 3) != 0) return refuse(req, 405, "only GET is served");
  size_t p = 0;
  for (size_t i = t0; i < t && l[i] != '?' && l[i] != '#'; i++) req->path[p++] = l[i];
  req->path[p] = '\0';
  return MOK_HTTP_NEED_MORE;
}

static bool name_is(const char *name, size_t n, const char *want) {
  return strlen(want) == n && strncasecmp(name, want, n) == 0;
}

static mok_http_verdict parse_header(const char *l, size_t n, mok_http_request *req,
                                     unsigned *hosts) {
  if (l[0] == ' ' || l[0] == '\t') return refuse(req, 400, "folded header lines are refused");
  size_t c = 0;
  while (c < n && is_tchar((unsigned char)l[c])) c++;
  if (c == 0 || c >= n || l[c] != ':') return refuse(req, 400, "malformed header line");
  size_t v = c + 1, e = n;
  while (v < e && (l[v] == ' ' || l[v] == '\t')) v++;
  while (e > v && (l[e - 1] == ' ' || l[e - 1] == '\t')) e--;
  for (size_t i = v; i < e; i++) {
    unsigned char ch = (unsigned char)l[i];
    if (ch != ' ' && ch != '\t' && !is_vchar(ch) && ch < 0x80)
      return refuse(req, 400, "control character in a header value");
  }
  if (name_is(l, c, "host") && ++*hosts > 1) return refuse(req, 400, "more than one Host header");
  if (name_is(l, c, "transfer-encoding")) return refuse(req, 400, "a GET has no body");
  if (name_is(l, c, "content-length")) {
    if (v == e) return refuse(req, 400, "empty Content-Length");
    for (size_t i = v; i < e; i++)
      if (l[i] != '0') return refuse(req, 400, "a GET has no body");
  }
  return MOK_HTTP_NEED_MORE;
}

mok_http_verdict mok_http_parse(const char *buf, size_t len, mok_http_request *req) {
  req->status = 0;
  req->why = NULL;
  req->minor = -1;
  req->n_headers = 0;
  req->head_bytes = 0;
  req->path[0] = '\0';
  unsigned hosts = 0;
  size_t pos = 0;
  for (unsigned line = 0;; line++) {
    /* the end of this line: CRLF only */
    size_t i = pos;
    bool complete = false;
    for (; i < len; i++) {
      char ch = buf[i];
      if (ch == '\0') return refuse(req, 400, "NUL byte in the request");
      if (ch == '\n') return refuse(req, 400, "bare LF (lines end with CRLF)");
      if (ch == '\r') {
        if (i + 1 == len) break;
        if (buf[i + 1] != '\n') return refuse(req, 400, "bare CR");
        complete = true;
        break;
      }
      /* judged byte by byte, so that later bytes never change a verdict */
      if (line == 0 && i - pos >= REQUEST_LINE_MAX) return refuse(req, 414, "request line too long");
    }
    if (!complete) {
      if (len >= MOK_HTTP_MAX_REQUEST) return refuse(req, 413, "request head too large");
      return MOK_HTTP_NEED_MORE;
    }
    if (i + 2 > MOK_HTTP_MAX_REQUEST) return refuse(req, 413, "request head too large");
    const char *l = buf + pos;
    size_t n = i - pos;
    if (line == 0) {
      if (parse_request_line(l, n, req) == MOK_HTTP_ERROR) return MOK_HTTP_ERROR;
    } else if (n == 0) {
      if (req->minor == 1 && hosts == 0) return refuse(req, 400, "HTTP/1.1 without Host");
      req->head_bytes = i + 2;
      return MOK_HTTP_DONE;
    } else {
      if (++req->n_headers > MOK_HTTP_MAX_HEADERS) return refuse(req, 431, "too many headers");
      if (parse_header(l, n, req, &hosts) == MOK_HTTP_ERROR) return MOK_HTTP_ERROR;
    }
    pos = i + 2;
  }
}

const char *mok_http_reason(int status) {
  switch (status) {
  case 200: return "OK";
  case 400: return "Bad Request";
  case 403: return "Forbidden";
  case 404: return "Not Found";
  case 405: return "Method Not Allowed";
  case 408: return "Request Timeout";
  case 413: return "Content Too Large";
  case 414: return "URI Too Long";
  case 431: return "Request Header Fields Too Large";
  case 500: return "Internal Server Error";
  case 503: return "Service Unavailable";
  case 505: return "HTTP Version Not Supported";
  default: return "";
  }
}

size_t mok_http_response_head(char *buf, size_t cap, int status, const char *content_type,
                              size_t body_len) {
  int n = snprintf(buf, cap,
                   "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n%s"
                   "Cache-Control: no-store\r\nConnection: close\r\n\r\n",
                   status, mok_http_reason(status), content_type, body_len,
                   status == 405 ? "Allow: GET\r\n" : "");
  return n < 0 || (size_t)n >= cap ? 0 : (size_t)n;
}
