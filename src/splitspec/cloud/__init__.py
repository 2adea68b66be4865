"""The untrusted side: a trunk server with per-session KV caches."""
