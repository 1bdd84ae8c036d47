"""Server-rendered pages: the MSP console (operators) and the tenant portal, on one layout."""
