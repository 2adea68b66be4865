"""The only package that imports websockets: binary frames over WebSocket connections."""
