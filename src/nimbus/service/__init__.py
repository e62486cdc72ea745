"""The nimbus service: REST API, registry, per-endpoint queues and auth.

``nimbus.service.app.create_app`` builds the ASGI app and
``nimbus.service.server.serve`` runs it with uvicorn (``nimbus service start``).
What the SDK and the endpoint daemons share with it (the wire messages, version
stamps, the WebSocket client) is ``nimbus.protocol``, a layer below; the service
imports it, never the other way round.
"""
