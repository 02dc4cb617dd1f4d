"""The admin console's assets: Jinja templates (``templates/``), static files served by the gateway
(``static/``, :data:`STATIC_FILES`; no CDN, no build step), the charts (:mod:`.charts`, drawn in the browser by
the vendored Chart.js) and the lineage graph (:mod:`.svg`). The routes are
:mod:`livelora.gateway.api.console` and :mod:`livelora.gateway.api.console_actions`.
"""

#: Files ``GET /console/static/{name}`` serves, with their media types (nothing else is served).
STATIC_FILES = {
    "console.css": "text/css",
    "htmx.min.js": "text/javascript",
    "htmx.LICENSE": "text/plain",
    "console-charts.js": "text/javascript",
    "vendor/chart.umd.min.js": "text/javascript",
    "vendor/chart.js.LICENSE": "text/plain",
}

#: Third-party files shipped unchanged: file → project, version, licence, sha256 of the file, where it came from.
VENDORED = {
    "htmx.min.js": {
        "project": "htmx (https://htmx.org)",
        "version": "2.0.11",
        "license": "0BSD, static/htmx.LICENSE",
        "sha256": "d6fdc75f204e6bdefa99b69bf1e6d4ac69b8a364f77929f45c13476b4000f717",
        "source": "npm package htmx.org@2.0.11, dist/htmx.min.js",
    },
    "vendor/chart.umd.min.js": {
        "project": "Chart.js (https://www.chartjs.org)",
        "version": "4.6.2",
        "license": "MIT, static/vendor/chart.js.LICENSE",
        "sha256": "3f288f4f26882c26b58931fb586a9b4f30370b5de38d69dc005b0bd05b08e113",
        "source": "npm package chart.js@4.6.2, dist/chart.umd.min.js",
    },
}
