/* Tessera page behaviour without inline handlers (the Content-Security-Policy forbids them).
   <form data-confirm="Question?">  asks before submitting.
   <select data-autosubmit>         submits its form on change. */
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
  document.addEventListener("change", function (event) {
    var el = event.target;
    if (el && el.hasAttribute && el.hasAttribute("data-autosubmit") && el.form) {
      el.form.submit();
    }
  });
})();
