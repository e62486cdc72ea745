"""The nimbus service: REST API, registry, per-endpoint queues and auth.

``nimbus.service.app.create_app`` builds the ASGI app and
``nimbus.service.server.serve`` runs it with uvicorn (``nimbus service start``).
``nimbus.protocol`` holds what the SDK and the endpoint agents share with
it (message shapes, version stamps); importing it does not import the app.
"""
