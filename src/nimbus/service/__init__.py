"""The nimbus service, the control plane: REST API, registry, per-endpoint queues and auth.

Owns the server side only: ``nimbus.service.app.create_app`` builds the ASGI
app and ``nimbus.service.server.serve`` runs it with uvicorn (``nimbus service
start``, in ``nimbus.cli.service``). It stores and forwards user payloads as
bytes, never unpickles them, and imports neither the SDK nor the CLI. What the
SDK and the endpoint daemons share with it (the wire messages, version stamps,
the WebSocket client) is ``nimbus.protocol``, a layer below; the service
imports it, never the other way round.
"""
