// nimbus dashboard: live pages over server-sent events. follow() opens a page's stream
// (pages.js builds on it too); the live rows of the tasks and batches pages are here.
// Rows are built with textContent only: what a user controls is never markup.
"use strict";

// Follow the stream at `url`: each `event` carries one JSON item for `onItem(item)`, and
// the page's "live" mark says whether the stream is open or reconnecting.
function follow(url, event, onItem) {
  const status = document.getElementById("live");
  const source = new EventSource(url);
  source.addEventListener(event, function (message) {
    onItem(JSON.parse(message.data));
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
  return source;
}

(function () {
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
  function followRows(tableId, event, attribute, field, fill, flash) {
    const table = document.getElementById(tableId);
    if (!table || !table.dataset.stream) {
      return;
    }
    const body = table.tBodies[0];
    follow(table.dataset.stream, event, function (item) {
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
  }

  // a task's or batch's id: its head and its tail, as _html.short
  function short(id) {
    return id.length <= 13 ? id : id.slice(0, 8) + "\u2026" + id.slice(-4);
  }

  const columns = ["state", "function", "endpoint", "submitted", "dispatched", "ended"];
  followRows("tasks", "task", "task", "task_id", function (row, task) {
    const link = document.createElement("a");
    link.href = "/tasks/" + encodeURIComponent(task.task_id);
    link.textContent = short(task.task_id);
    cell(row, "").appendChild(link);
    for (const name of columns) {
      cell(row, task[name], name === "state" ? "state " + task.state : "");
    }
  }, true);

  followRows("batches", "batch", "group", "group_id", function (row, batch) {
    cell(row, short(batch.group_id));
    cell(row, batch.submitted);
    const bar = document.createElement("progress");
    bar.max = Math.max(1, batch.total);
    bar.value = batch.done;
    cell(row, "").appendChild(bar);
    cell(row, batch.done + "/" + batch.total, "done");
    cell(row, batch.states, "counts");
  }, false);
})();
