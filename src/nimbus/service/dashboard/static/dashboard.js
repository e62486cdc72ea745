// nimbus dashboard: live rows of the tasks and batches pages over server-sent events.
// Rows are built with textContent only: what a user controls is never markup.
"use strict";

(function () {
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

  // Follow the stream named by the table's data-stream: each `event` carries one item,
  // whose `field` names its row (the row's data-`attribute`); `fill(row, item)` draws it.
  function follow(tableId, event, attribute, field, fill, flash) {
    const table = document.getElementById(tableId);
    if (!table || !table.dataset.stream) {
      return;
    }
    const body = table.tBodies[0];
    const source = new EventSource(table.dataset.stream);
    source.addEventListener(event, function (message) {
      const item = JSON.parse(message.data);
      let row = null;
      for (const tr of body.rows) {
        if (tr.dataset[attribute] === item[field]) {
          row = tr;
          break;
        }
      }
      if (row === null) {
        row = document.createElement("tr");
        row.dataset[attribute] = item[field];
        body.insertBefore(row, body.firstChild);
      }
      row.replaceChildren();
      fill(row, item);
      if (flash) {
        row.classList.remove("fresh");
        void row.offsetWidth;
        row.classList.add("fresh");
      }
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
  }

  const columns = ["state", "function", "endpoint", "submitted", "dispatched", "ended"];
  follow("tasks", "task", "task", "task_id", function (row, task) {
    const link = document.createElement("a");
    link.href = "/tasks/" + encodeURIComponent(task.task_id);
    link.textContent = task.task_id.slice(0, 8);
    cell(row, "").appendChild(link);
    for (const name of columns) {
      cell(row, task[name], name === "state" ? "state " + task.state : "");
    }
  }, true);

  follow("batches", "batch", "group", "group_id", function (row, batch) {
    cell(row, batch.group_id.slice(0, 8));
    cell(row, batch.submitted);
    const bar = document.createElement("progress");
    bar.max = Math.max(1, batch.total);
    bar.value = batch.done;
    cell(row, "").appendChild(bar);
    cell(row, batch.done + "/" + batch.total, "done");
    cell(row, batch.states, "counts");
  }, false);
})();
