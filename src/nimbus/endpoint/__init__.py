"""Endpoints: the agent that serves one endpoint of the nimbus service from this machine.

Owns the endpoint side of the service: ``nimbus.endpoint.agent`` runs the
runtime's Agent fed by the service over a WebSocket, and
``nimbus.endpoint.config`` keeps each endpoint's settings and token in
``~/.config/nimbus/endpoints/NAME``. The ``nimbus endpoint ...`` commands that
configure, start and stop it are in ``nimbus.cli.endpoint``.
"""
