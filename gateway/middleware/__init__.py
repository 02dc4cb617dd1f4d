"""The gateway's ASGI middlewares: authentication (:mod:`.auth`), request metrics (:mod:`.metrics`), drain
(:mod:`.drain`)."""
