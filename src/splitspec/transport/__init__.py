"""The only package that imports websockets: binary frames over WebSocket connections."""

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})  # hosts that never leave this machine
