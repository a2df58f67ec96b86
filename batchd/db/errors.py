"""Transient database errors (worth another try) against permanent ones (the same every time).

A transient error is the database being away or busy for a while: a dropped connection, a
server restarting, a lock held by another writer, a serialization conflict. Retrying the
same statement later can succeed. A permanent error is the statement or its values: a number
out of a column's range, a constraint it breaks, a table that is not there. Retrying it fails
the same way forever, so a job that meets one must fail instead of going back to the queue
(a poison loop: issue 38).

PostgreSQL says which is which by SQLSTATE class; SQLite by its primary result code. An
error from neither (a Python value the driver cannot bind, such as an int beyond 64 bits) is
permanent.
"""
from __future__ import annotations

from typing import Optional

from sqlalchemy.exc import DBAPIError, DisconnectionError, InterfaceError, OperationalError

# SQLSTATE classes: 08 connection exception, 53 insufficient resources, 57 operator
# intervention (admin shutdown, cannot connect now), 58 system error (I/O)
TRANSIENT_SQLSTATE_CLASSES = frozenset({"08", "53", "57", "58"})
# serialization failure, deadlock detected, lock not available, object in use, statement timeout
TRANSIENT_SQLSTATES = frozenset({"40001", "40P01", "55P03", "55006", "57014"})
# SQLite primary result codes: BUSY, LOCKED, IOERR, FULL (disk), CANTOPEN, PROTOCOL
TRANSIENT_SQLITE_CODES = frozenset({5, 6, 10, 13, 14, 15})


def is_transient(exc: BaseException) -> bool:
    """True when retrying later may succeed (the database was unreachable or busy); False for
    an error of the statement or its values, and for anything that is not a database error."""
    if isinstance(exc, DisconnectionError):
        return True
    if not isinstance(exc, DBAPIError):
        return False
    if exc.connection_invalidated:
        return True
    code = sqlstate(exc.orig)
    if code is not None:
        return code[:2] in TRANSIENT_SQLSTATE_CLASSES or code in TRANSIENT_SQLSTATES
    sqlite_code = getattr(exc.orig, "sqlite_errorcode", None)
    if sqlite_code is not None:
        return sqlite_code & 0xFF in TRANSIENT_SQLITE_CODES
    # no code: the driver lost or could not open its connection
    return isinstance(exc, (OperationalError, InterfaceError))


def sqlstate(error: object) -> Optional[str]:
    """The SQLSTATE of a PostgreSQL driver error (psycopg2's pgcode, psycopg 3's sqlstate)."""
    code = getattr(error, "pgcode", None) or getattr(error, "sqlstate", None)
    return code if isinstance(code, str) and len(code) == 5 else None


def one_line(exc: BaseException) -> str:
    """`DataError: integer out of range`: the driver's first line, without SQL or parameters."""
    inner = getattr(exc, "orig", None) or exc
    first = (str(inner).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
