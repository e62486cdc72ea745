"""The service's dashboard at ``/``: endpoints (blocks, managers, workers busy and
idle, live, ``_endpoints``), tasks (paged, live), a task (record, traceback, output,
``_task``), the task stream per worker and its PNG (``_timeline``), network (per-task
bytes and throughput, ``_network``), batches (each submit's progress, live,
``_batches``), the messaging directory (``_directory``), and the cancel and share
buttons (``_actions``).

Server-rendered HTML, a little vanilla JavaScript, served by the service's own
ASGI app (``app.include_router(router)``). Why this stack:

- Nothing to build and nothing to fetch: the pages are Python f-strings of
  escaped parts (``_html``) and the two static files (``static/``) ship inside
  the package, so a fresh install serves the dashboard with no step and no
  network. No template engine or JS framework to keep up to date for years.
- The security rules live in one place each: every value is escaped by
  ``_html.esc`` where it is placed, the live rows are built in the browser with
  ``textContent`` (never ``innerHTML``), and a Content-Security-Policy forbids
  inline scripts; the token stays out of URLs (``_session``: a login form, an
  HttpOnly SameSite=Strict session cookie, CSRF tokens on every POST).
- Live updates are server-sent events (``EventSource``): one HTTP response the
  server writes to when rows change, which browsers reconnect by themselves; the
  page never polls. htmx would add little over the ~60 lines of JS it needs.
  The server does not poll either: the task store's scripts publish when tasks
  move and one subscription per service process wakes its open streams
  (``_live``), so an open page costs nothing while nothing changes.

Reads go through the registry and the per-user task index (a sorted set in the
queue Redis) with keyset pagination (``nimbus.service.listing``: one Lua call a page, reading only
that page's rows), never a scan of the history.
"""

from __future__ import annotations

from nimbus.service.dashboard import (
    _actions,
    _batches,
    _directory,
    _endpoints,
    _network,
    _task,
    _tasks,
    _timeline,
)
from nimbus.service.dashboard._routes import router

_PAGES = (_endpoints, _tasks, _task, _timeline, _network, _batches, _directory, _actions)
for _pages in _PAGES:
    router.include_router(_pages.router)  # _tasks before _task: /tasks/stream before /tasks/{id}

__all__ = ["router"]
