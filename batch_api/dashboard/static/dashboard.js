/* holdback dashboard: the few behaviours htmx attributes do not cover. No inline script, so the CSP holds. */
(function () {
  "use strict";
  function banner(text) {
    var el = document.getElementById("connection");
    if (!el) return;
    el.textContent = text || "";
    el.hidden = !text;
  }
  document.addEventListener("htmx:sendError", function () {
    banner("Live updates paused: the API server did not answer. Retrying every 2 s…");
  });
  document.addEventListener("htmx:responseError", function (e) {
    var status = e.detail && e.detail.xhr ? e.detail.xhr.status : "?";
    if (status >= 500) banner("Live updates paused: the API server answered HTTP " + status + ". Retrying every 2 s…");
  });
  document.addEventListener("htmx:afterRequest", function (e) {
    if (e.detail && e.detail.successful) banner("");
  });
  document.addEventListener("click", function (e) {
    var dismiss = e.target.closest("[data-dismiss]");
    if (dismiss) dismiss.closest(".flash").remove();
    if (e.target.closest("[data-close-drawer]")) document.getElementById("drawer").replaceChildren();
  });
  document.addEventListener("keydown", function (e) {
    if (e.key === "Escape") document.getElementById("drawer").replaceChildren();
  });
})();
