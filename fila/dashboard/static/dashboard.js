// Live refresh for the Fila dashboard: every element with a data-live URL is
// re-fetched every data-refresh-ms (on <body>) and its content replaced with the
// server-rendered fragment. The fragments are escaped by the server's templates;
// this script never builds markup from data itself.
"use strict";

(function () {
  const period = Number(document.body.dataset.refreshMs) || 2000;
  const offline = document.getElementById("offline");
  const busy = new WeakSet();

  async function refresh(element) {
    if (busy.has(element)) {
      return; // the previous fetch is still running: skip this tick
    }
    busy.add(element);
    try {
      const response = await fetch(element.dataset.live, {
        credentials: "same-origin",
        cache: "no-store",
        headers: { Accept: "text/html" },
      });
      if (response.status === 401) {
        window.location.reload(); // the session ended: the reload leads to the login form
        return;
      }
      if (offline) {
        offline.hidden = true;
      }
      if (response.ok) {
        element.innerHTML = await response.text();
        element.dataset.refreshedAt = String(Date.now());
      }
    } catch (error) {
      if (offline) {
        offline.hidden = false; // the dashboard process itself did not answer
      }
    } finally {
      busy.delete(element);
    }
  }

  function tick() {
    if (document.hidden) {
      return; // no refresh for a background tab
    }
    document.querySelectorAll("[data-live]").forEach(refresh);
  }

  window.setInterval(tick, period);
  document.addEventListener("visibilitychange", tick);
})();
