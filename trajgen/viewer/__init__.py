"""The trajectory viewer (--view) and the run report (--report).

index.py         byte-offset index over the run's JSONL files, extended as they grow
query.py         search, filters and pages over the index
summary.py       the run at a glance: statistics.json's numbers, counted from the index
render.py        the summary as HTML with inline SVG; report.html
conversation.py  one prompt's record as the viewer shows it
server.py        the HTTP server on 127.0.0.1 and its JSON API
command.py       the two flags: check, index, serve or write
comparison.py    a comparison of runs (trajgen/compare.py) as comparison.html and as the viewer's side-by-side pages
static/          the page, its script and stylesheet (no build step, nothing fetched from elsewhere)
"""
