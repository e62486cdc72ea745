"""Endpoints: an agent that serves one endpoint of the nimbus service from this machine.

``nimbus.endpoint.daemon.EndpointDaemon`` runs the runtime's Agent fed by the
service; ``nimbus.endpoint.config`` keeps each endpoint's settings and token;
``nimbus.endpoint.cli`` is ``nimbus endpoint ...``.
"""
