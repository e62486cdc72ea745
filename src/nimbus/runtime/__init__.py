"""The runtime: the engine that runs tasks (one agent, its managers, their workers).

Owns task execution on one endpoint or embedded in this process:
``nimbus.runtime.agent`` receives tasks and routes them to managers,
``nimbus.runtime.manager`` keeps one node's warm workers, ``nimbus.runtime.worker``
runs one task at a time, and ``nimbus.runtime.task`` / ``messages`` are the
one-way ``Task`` and the messages between them. It never imports the SDK, the
service or the CLI; this module imports nothing, so a worker starts fast.
"""
