"""The largest integers a job's params may hold: what the columns they are stored in can hold.

A value the database cannot store fails the job's result insert long after the job ran (on
PostgreSQL `integer out of range`; on SQLite an int beyond 64 bits cannot even be bound), so
every integer param is checked against its `results` column at submit and again when a
worker claims the job (a row written by SQL skips submit). Params that have no column are
counts of tokens: a 32-bit integer is plenty.
"""
from __future__ import annotations

from typing import Any

from sqlalchemy import BigInteger, Column

from batchd.db.models import Result
from batchd.engine.errors import BadInputError

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
RESULTS = Result.__table__

# param -> the results column its value is written to (the job's configuration fingerprint)
PARAM_COLUMNS: dict[str, Column] = {name: RESULTS.c[name] for name in ("max_new_tokens", "top_k", "seed",
                                                                       "spec_width")}


def integer_limit(param: str) -> int:
    """The largest value `param` may hold: its column's (Integer 2**31-1, BigInteger 2**63-1)."""
    column = PARAM_COLUMNS.get(param)
    return INT64_MAX if column is not None and isinstance(column.type, BigInteger) else INT32_MAX


def check_integer_limits(params: dict[str, Any]) -> None:
    """Raise BadInputError for an integer param beyond what its column stores."""
    for key, value in params.items():
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > integer_limit(key):
            raise BadInputError(f"param {key}={value}: too large; at most {integer_limit(key)}")
