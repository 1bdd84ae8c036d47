"""The portal's and the console's PDF downloads (billing.documents makes them)."""

from __future__ import annotations

from django.contrib import messages
from django.http import HttpResponse
from django.shortcuts import redirect

from marketplace.services.billing import documents


def pdf_response(request, make, doc, back: str):
    """`doc`'s PDF as an attachment; when the PDF library cannot be loaded here, back to `back` saying why (the
    pages show the reason in place of the link already: `documents.unavailable()`)."""
    try:
        body = make(doc)
    except documents.PdfUnavailable as exc:
        messages.error(request, f"No PDF: {exc}")
        return redirect(back)
    response = HttpResponse(body, content_type="application/pdf")
    response["Content-Disposition"] = f'attachment; filename="{documents.filename(doc)}"'
    return response
