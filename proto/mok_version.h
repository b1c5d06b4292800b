/* SPDX-License-Identifier: Apache-2.0 */
/* The version of mok: the one place it is written. mokd, mokctl and libmok
 * report it (mokd --version, mokctl --version, mok_version()), the Python
 * binding reads it through libmok, and the Makefile takes it from here for
 * the pkg-config file. Installed beside mok.h. */
#ifndef MOK_VERSION_H
#define MOK_VERSION_H

#define MOK_VERSION "0.1.0"

#endif
