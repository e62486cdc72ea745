"""Endpoints: the daemon that serves one endpoint of the nimbus service from this machine.

``nimbus.endpoint.daemon.EndpointDaemon`` is that process: it hosts the
endpoint's runtime agent (``nimbus.runtime.Agent``) and links it to the service
over the shared WebSocket client (``nimbus.protocol.wsclient``);
``nimbus.endpoint.config`` keeps each endpoint's settings and token in
``~/.config/nimbus/endpoints/NAME``. The ``nimbus endpoint ...`` commands that
configure, start and stop it are in ``nimbus.cli.endpoint``.
"""
