/* Tessera page behaviour without inline handlers (the Content-Security-Policy forbids them).
   <form data-confirm="Question?">  asks before submitting.
   <select data-autosubmit>         submits its form on change.
   <button data-menu-toggle>        opens and closes the top navigation on a phone. */
(function () {
  "use strict";
  document.addEventListener("submit", function (event) {
    var form = event.target;
    if (form instanceof HTMLFormElement && form.hasAttribute("data-confirm")) {
      if (!window.confirm(form.getAttribute("data-confirm"))) {
        event.preventDefault();
        event.stopImmediatePropagation();
      }
    }
  }, true);
  // <button data-menu-toggle aria-controls="topnav">: on a phone the top navigation is collapsed behind it.
  document.documentElement.classList.add("js");
  document.addEventListener("click", function (event) {
    var button = event.target && event.target.closest ? event.target.closest("[data-menu-toggle]") : null;
    if (!button) { return; }
    var bar = button.closest(".topbar");
    var open = !bar.classList.contains("open");
    bar.classList.toggle("open", open);
    button.setAttribute("aria-expanded", open ? "true" : "false");
  });
  // A table wider than its container scrolls sideways inside it: say so above it (once), keep its first column in
  // view (CSS: .table-wrap.scrolls), and drop the hint's arrow once the last column has been reached.
  function markScrolling() {
    var wraps = document.querySelectorAll(".table-wrap");
    for (var i = 0; i < wraps.length; i++) {
      var wrap = wraps[i];
      var scrolls = wrap.scrollWidth > wrap.clientWidth + 1;
      wrap.classList.toggle("scrolls", scrolls);
      var hint = wrap.previousElementSibling;
      var has = hint && hint.classList.contains("scroll-hint");
      if (scrolls && !has) {
        hint = document.createElement("p");
        hint.className = "scroll-hint muted";
        hint.textContent = "More columns: scroll the table sideways →";
        wrap.parentNode.insertBefore(hint, wrap);
      } else if (!scrolls && has) {
        hint.remove();
      }
    }
  }
  document.addEventListener("DOMContentLoaded", markScrolling);
  window.addEventListener("resize", markScrolling);
  document.addEventListener("htmx:afterSettle", markScrolling);
  document.addEventListener("scroll", function (event) {
    var wrap = event.target;
    if (wrap && wrap.classList && wrap.classList.contains("table-wrap")) {
      wrap.classList.toggle("at-end", wrap.scrollLeft + wrap.clientWidth >= wrap.scrollWidth - 1);
    }
  }, true);
  // <select data-names="#input"> whose options carry data-served-as: choosing one fills the name input with the
  // name the model is served by (it cannot be another) and makes it read-only; choosing none frees it again.
  function namesFor(select) {
    var input = document.querySelector(select.getAttribute("data-names"));
    if (!input) { return; }
    var option = select.options[select.selectedIndex];
    var served = option ? option.getAttribute("data-served-as") : "";
    if (select.value && served) {
      input.value = served;
      input.readOnly = true;
    } else if (input.readOnly) {
      input.readOnly = false;
      input.value = "";
    }
  }
  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("select[data-names]").forEach(namesFor);
  });
  document.addEventListener("change", function (event) {
    if (event.target && event.target.matches && event.target.matches("select[data-names]")) {
      namesFor(event.target);
    }
  });
  document.addEventListener("change", function (event) {
    var el = event.target;
    if (el && el.hasAttribute && el.hasAttribute("data-autosubmit") && el.form) {
      el.form.submit();
    }
  });
})();
