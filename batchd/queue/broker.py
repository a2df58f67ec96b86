"""Is the broker there? One quick ping, and the errors that mean "it is not"."""
from __future__ import annotations

from typing import Optional

import redis
from kombu.exceptions import OperationalError

# what publishing raises when the broker cannot be reached (kombu wraps most; redis-py's own
# connection errors pass through some of its paths)
BROKER_UNREACHABLE = (OperationalError, redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


def broker_problem(url: str, timeout_s: float = 5.0) -> Optional[str]:
    """None when the broker at `url` answers a PING, else why not (one line, no credentials:
    redis-py's messages name the host and port only)."""
    client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        client.ping()
        return None
    except redis.RedisError as exc:
        return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    finally:
        client.close()
