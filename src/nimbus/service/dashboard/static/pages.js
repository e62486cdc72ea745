// nimbus dashboard: the endpoint page and the timeline, live over server-sent events.
// Text is placed with textContent and drawn on a canvas with fillText: never markup.
// Their streams are opened by dashboard.js's follow() (every page loads it first).
"use strict";

// the endpoint page: its status, blocks, managers and workers as the last heartbeat said
(function () {
  const table = document.getElementById("endpoint");
  if (!table || !table.dataset.stream) {
    return;
  }

  function fillTable(id, rows) {
    const found = document.getElementById(id);
    if (!found || found.tagName !== "TABLE") {
      return; // the page said there were none; a reload shows a new table
    }
    const body = found.tBodies[0];
    body.replaceChildren();
    for (const values of rows) {
      const tr = document.createElement("tr");
      for (const value of values) {
        const td = document.createElement("td");
        td.textContent = value === null || value === undefined ? "" : String(value);
        tr.appendChild(td);
      }
      body.appendChild(tr);
    }
  }

  follow(table.dataset.stream, "endpoint", function (view) {
    for (const cell of table.querySelectorAll("td[data-field]")) {
      const value = view[cell.dataset.field];
      if (value !== undefined) {
        cell.textContent = String(value);
      }
    }
    fillTable("blocks", view.blocks);
    fillTable("managers", view.managers);
    fillTable("pools", view.pools);
  });
})();

// the timeline: a lane per worker, a bar per task (queued, then its run by state)
(function () {
  const canvas = document.getElementById("timeline");
  if (!canvas || !canvas.dataset.stream) {
    return;
  }
  const colours = JSON.parse(canvas.dataset.colours);
  for (const key of document.querySelectorAll("span.key")) {
    key.style.borderLeft = "1em solid " + key.dataset.colour;
    key.style.paddingLeft = "0.3em";
  }
  const spans = new Map();
  let skew = 0; // the service's clock minus this browser's
  let queued = false;
  const LANE = 18;
  const LEFT = 220;

  function draw() {
    queued = false;
    const bars = Array.from(spans.values());
    const lanes = Array.from(new Set(bars.map((b) => b.lane))).sort();
    const now = Date.now() / 1000 + skew;
    const height = Math.max(60, 30 + LANE * lanes.length);
    if (canvas.height !== height) {
      canvas.height = height;
    }
    const ctx = canvas.getContext("2d");
    ctx.fillStyle = "#ffffff";
    ctx.fillRect(0, 0, canvas.width, canvas.height);
    let start = Infinity;
    let end = 0;
    for (const b of bars) {
      if (b.q0) {
        start = Math.min(start, b.q0);
      }
      end = Math.max(end, b.r1 || (b.r0 || b.q0 ? now : 0));
    }
    if (!bars.length || !isFinite(start)) {
      ctx.fillStyle = "#6b7280";
      ctx.fillText("no tasks yet", LEFT, 30);
      canvas.dataset.drawn = "0";
      return;
    }
    const span = Math.max(end - start, 0.001);
    const scale = (canvas.width - LEFT - 10) / span;
    const x = (t) => LEFT + (t - start) * scale;
    ctx.font = "11px sans-serif";
    ctx.textBaseline = "middle";
    lanes.forEach(function (lane, i) {
      ctx.fillStyle = "#1d2430";
      ctx.fillText(lane.length > 34 ? "..." + lane.slice(-33) : lane, 4, 20 + i * LANE + LANE / 2);
    });
    const row = new Map(lanes.map((lane, i) => [lane, i]));
    let running = 0;
    for (const b of bars) {
      const y = 20 + row.get(b.lane) * LANE;
      const begin = b.r0 || now;
      if (b.q0 && begin > b.q0) {
        ctx.fillStyle = colours.queued;
        ctx.fillRect(x(b.q0), y + 2, Math.max(1, (begin - b.q0) * scale), LANE - 4);
      }
      if (b.r0) {
        const stop = b.r1 || now;
        running += b.r1 ? 0 : 1;
        ctx.fillStyle = colours[b.state] || "#6b7280";
        ctx.fillRect(x(b.r0), y + 3, Math.max(1, (stop - b.r0) * scale), LANE - 6);
      }
    }
    ctx.fillStyle = "#6b7280";
    ctx.fillText(span.toFixed(1) + " s", canvas.width - 60, 10);
    canvas.dataset.drawn = String(bars.length);
    canvas.dataset.running = String(running);
    canvas.dataset.lanes = lanes.join("\n");
  }

  function later() {
    if (!queued) {
      queued = true;
      window.requestAnimationFrame(draw);
    }
  }

  follow(canvas.dataset.stream, "spans", function (data) {
    skew = data.now - Date.now() / 1000;
    for (const b of data.spans) {
      spans.set(b.id, b);
    }
    canvas.dataset.states = JSON.stringify(Object.fromEntries(
      Array.from(spans.values()).map((b) => [b.id, b.state])));
    later();
  });
  const save = document.getElementById("png-canvas");
  if (save) {
    save.addEventListener("click", function () {
      canvas.toBlob(function (blob) {
        const link = document.createElement("a");
        link.href = URL.createObjectURL(blob);
        link.download = "timeline-canvas.png";
        link.click();
        window.setTimeout(() => URL.revokeObjectURL(link.href), 1000);
      }, "image/png");
    });
  }
  window.setInterval(function () {
    if (canvas.dataset.running && canvas.dataset.running !== "0") {
      later(); // running bars grow with the clock
    }
  }, 500);
})();
