"""The web console: a page and a versioned JSON API over one member's control socket (issue 31).

app.py: the aiohttp application (the API, the page's files, authentication, live updates);
openapi.py: the API's OpenAPI description; static/: the page (HTML, a script, a style
sheet: everything it loads is served from here). `swarmctl console` runs it.
"""
