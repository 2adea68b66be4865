"""An OpenAI-compatible HTTP server on the trusted edge (``splitspec serve``).

The private split model behind the OpenAI API: ``/v1/chat/completions``, ``/v1/completions``,
``/v1/responses`` and ``/v1/models`` with the standard schemas and SSE streaming, plus ``/health``
and a Prometheus ``/metrics``. Each request runs on its own cloud session, taken from a bounded pool of
:class:`~splitspec.edge.SplitClient`; idle sessions are kept in an LRU keyed by their token
sequence so that a chat client resending its conversation sends only the new turn over the WAN.
Edge side only: nothing here imports ``splitspec.cloud``.
"""

from splitspec.serve.config import ServeConfig

__all__ = ["ServeConfig"]
