# SPDX-License-Identifier: Apache-2.0
"""mok.Error: every failure of the binding and of mokd."""
from __future__ import annotations

from typing import Optional, Union

from ._lib import STATUS_CODES, STATUS_NAMES


class Error(Exception):
    """A mok failure: .status is the status name ("EINVAL", "EROUTE", ...), .code its
    number (proto/mok_status.h), .message what mokd (or the binding) said."""

    status: str
    code: int
    message: str

    def __init__(self, status: Union[str, int], message: Optional[str] = None) -> None:
        if message is None and isinstance(status, str) and status not in STATUS_CODES:
            status, message = "EINVAL", status
        if isinstance(status, int):
            code = status
            name = STATUS_NAMES[code] if 0 <= code < len(STATUS_NAMES) else "UNKNOWN(%d)" % code
        else:
            name = str(status)
            code = STATUS_CODES.get(name, -1)
        self.status = name
        self.code = code
        self.message = message or ""
        super().__init__("%s: %s" % (name, self.message) if self.message else name)

    def __reduce__(self):
        return (Error, (self.status, self.message))
