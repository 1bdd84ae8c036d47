/* A copy button without inline handlers (the Content-Security-Policy forbids them):
   <button type="button" data-copy="#key-secret">Copy</button> copies the text of the element the selector names.
   Where the Clipboard API is unavailable or refused, the text is selected so Ctrl+C / Cmd+C copies it. */
(function () {
  "use strict";
  function select(el) {
    var range = document.createRange();
    range.selectNodeContents(el);
    var sel = window.getSelection();
    sel.removeAllRanges();
    sel.addRange(range);
  }
  function say(button, text) {
    var status = document.getElementById(button.getAttribute("aria-describedby") || "");
    if (status) { status.textContent = text; }
  }
  document.addEventListener("click", function (event) {
    var button = event.target && event.target.closest ? event.target.closest("[data-copy]") : null;
    if (!button) { return; }
    var el = document.querySelector(button.getAttribute("data-copy"));
    if (!el) { return; }
    var text = el.textContent.trim();
    var fallback = function () { select(el); say(button, "Selected: press Ctrl+C (Cmd+C) to copy."); };
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(function () {
        button.textContent = "Copied";
        say(button, "Copied to the clipboard.");
      }, fallback);
    } else {
      fallback();
    }
  });
})();
