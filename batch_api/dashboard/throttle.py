"""Sign-in throttling: each client address gets `LOGIN_ATTEMPTS` sign-in tries per `LOGIN_WINDOW_SECONDS`.

Counted in Redis under the API's namespace, so every API process shares one count. A try is counted
before the key is checked and refunded when it was right: a burst of concurrent guesses cannot slip
past the limit between a check and its count.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

LOGIN_ATTEMPTS = 5
LOGIN_WINDOW_SECONDS = 60


@dataclass(frozen=True)
class LoginThrottle:
    connection: redis.Redis
    namespace: str

    def _key(self, client: str) -> str:
        return f"{self.namespace}:dashboard:login-attempts:{client}"

    def admit(self, client: str) -> int:
        """Count a try from `client`: 0 when it may go ahead, else the seconds until its window ends."""
        key = self._key(client)
        with self.connection.pipeline(transaction=True) as pipe:
            # The window starts at the first try and is not extended by later ones.
            pipe.set(key, 0, ex=LOGIN_WINDOW_SECONDS, nx=True)
            pipe.incr(key)
            pipe.ttl(key)
            _, tries, ttl = pipe.execute()
        if tries <= LOGIN_ATTEMPTS:
            return 0
        return max(1, int(ttl))

    def succeeded(self, client: str) -> None:
        """The key was right: the client's failures no longer count."""
        self.connection.delete(self._key(client))
