"""Serving: a request to its generation.

:mod:`.serve` (``model`` → weights; :meth:`~.serve.Serving.serve`, the one call of a generation),
:mod:`.checkpoint_names` (checkpoint paths as names), :mod:`.messages` (the Messages API as a chat), :mod:`.plans`
(request → engine jobs), :mod:`.request_fields` (which fields are honoured or refused), :mod:`.served` (a running
request), :mod:`.generation` (choices run together), :mod:`.sampling_defaults`, :mod:`.prompt_limits` (cheap
limits), :mod:`.admission`, :mod:`.token_texts`.
"""
