"""The nimbus service, the control plane: REST API, registry, per-endpoint queues and auth.

Owns the server side only: ``nimbus.service.app.create_app`` builds the ASGI
app and ``nimbus.service.server.serve`` runs it with uvicorn (``nimbus service
start``, in ``nimbus.cli.service``). It stores and forwards user payloads as
bytes, never unpickles them, and imports neither the SDK nor the CLI.
``nimbus.service.protocol`` holds what the SDK and the endpoint agents share with
it (message shapes, version stamps); importing it does not import the app.
"""
