/* SPDX-License-Identifier: Apache-2.0 */
/* mokd's configuration file: "key = value" lines, '#' comments.
 * Keys are the long command-line options without dashes. */
#ifndef MOK_CONFIG_H
#define MOK_CONFIG_H

#include <stddef.h>

#include "server.h"

/* Apply one key/value to cfg. Returns 0, or -1 with err filled. String
 * values are copied into storage owned by the config module. */
int mok_config_set(mok_server_config *cfg, const char *key, const char *value, char *err,
                   size_t errlen);

/* Parse a whole file's text. Returns 0, or -1 with err naming the line. */
int mok_config_parse(mok_server_config *cfg, const char *text, char *err, size_t errlen);

/* Read and parse a file. Returns 0 or -1 with err filled. */
int mok_config_load(mok_server_config *cfg, const char *path, char *err, size_t errlen);

/* The environment's overrides (config.c's table) into cfg: once, at
 * start-up, after the files and the command line. */
void mok_config_apply_env(mok_server_config *cfg);

#endif
