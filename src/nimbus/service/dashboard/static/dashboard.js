// nimbus dashboard: live rows of the tasks page over server-sent events.
// Rows are built with textContent only: what a user controls is never markup.
"use strict";

(function () {
  const table = document.getElementById("tasks");
  if (!table || !table.dataset.stream) {
    return;
  }
  const body = table.tBodies[0];
  const status = document.getElementById("live");
  const columns = ["state", "function", "endpoint", "submitted", "dispatched", "ended"];

  function cell(row, text, className) {
    const td = document.createElement("td");
    td.textContent = text;
    if (className) {
      td.className = className;
    }
    row.appendChild(td);
    return td;
  }

  function fill(row, task) {
    row.replaceChildren();
    const first = cell(row, "");
    const link = document.createElement("a");
    link.href = "/tasks/" + encodeURIComponent(task.task_id);
    link.textContent = task.task_id.slice(0, 8);
    first.appendChild(link);
    for (const name of columns) {
      cell(row, task[name], name === "state" ? "state " + task.state : "");
    }
  }

  function upsert(task) {
    let row = null;
    for (const tr of body.rows) {
      if (tr.dataset.task === task.task_id) {
        row = tr;
        break;
      }
    }
    if (row === null) {
      row = document.createElement("tr");
      row.dataset.task = task.task_id;
      body.insertBefore(row, body.firstChild);
    }
    fill(row, task);
    row.classList.remove("fresh");
    void row.offsetWidth;
    row.classList.add("fresh");
  }

  const source = new EventSource(table.dataset.stream);
  source.addEventListener("task", function (event) {
    upsert(JSON.parse(event.data));
  });
  source.addEventListener("open", function () {
    if (status) {
      status.textContent = "live";
      status.classList.remove("down");
    }
  });
  source.addEventListener("error", function () {
    if (status) {
      status.textContent = "reconnecting";
      status.classList.add("down");
    }
  });
})();

// the batches page: each batch's progress, live
(function () {
  const table = document.getElementById("batches");
  if (!table || !table.dataset.stream) {
    return;
  }
  const body = table.tBodies[0];
  const status = document.getElementById("live");

  function cell(row, text, className) {
    const td = document.createElement("td");
    td.textContent = text;
    if (className) {
      td.className = className;
    }
    row.appendChild(td);
    return td;
  }

  function upsert(batch) {
    let row = null;
    for (const tr of body.rows) {
      if (tr.dataset.group === batch.group_id) {
        row = tr;
        break;
      }
    }
    if (row === null) {
      row = document.createElement("tr");
      row.dataset.group = batch.group_id;
      body.insertBefore(row, body.firstChild);
    }
    row.replaceChildren();
    cell(row, batch.group_id.slice(0, 8));
    cell(row, batch.submitted);
    const bar = document.createElement("progress");
    bar.max = Math.max(1, batch.total);
    bar.value = batch.done;
    cell(row, "").appendChild(bar);
    cell(row, batch.done + "/" + batch.total, "done");
    cell(row, batch.states, "counts");
  }

  const source = new EventSource(table.dataset.stream);
  source.addEventListener("batch", function (event) {
    upsert(JSON.parse(event.data));
  });
  source.addEventListener("open", function () {
    if (status) {
      status.textContent = "live";
      status.classList.remove("down");
    }
  });
  source.addEventListener("error", function () {
    if (status) {
      status.textContent = "reconnecting";
      status.classList.add("down");
    }
  });
})();
