"""``kvplug serve``: the OpenAI-compatible routing frontend.

Modules, one job each: ``parsing`` (validate a client body), ``hints`` (routing hints from
``nvext`` and headers), ``tokens`` (token ids for routing), ``config`` (worker specs from flags
and YAML), ``fleet`` (workers, their adapters, event sinks and health), ``upstream`` (HTTP to the
engines), ``streaming`` (SSE pass-through and output counting), ``decisions`` (recent decision
traces), ``metrics`` (Prometheus), ``app`` (the public API), ``admin`` (the admin API), ``cli``.
"""
