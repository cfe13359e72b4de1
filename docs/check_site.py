"""Open every page of a built site in headless Chromium, served over http on 127.0.0.1, and fail on:

- a console error or an uncaught page error (a script that failed, a resource that did not load);
- a same-site request answered with an error status;
- an image that did not load (`naturalWidth == 0`);
- a link to a page of the site that does not exist, or to an #anchor its target page does not have.

Links to other sites are not followed (the check runs without a network). Chromium is the operating system's
(Debian/Ubuntu: `apt-get install chromium`), driven by Playwright through `executable_path`: Playwright's own
browser download is not needed.

    python docs/check_site.py SITE_DIR [--chromium PATH]      (run by `nox -s docs-browser`)
"""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import shutil
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import unquote, urldefrag, urlsplit

CANDIDATES = ("chromium", "chromium-browser", "chromium-headless-shell", "google-chrome", "google-chrome-stable")

# Every element id and <a name> of the page, every link's resolved href, every image's state.
PAGE_FACTS = """() => ({
    ids: [...document.querySelectorAll("[id]")].map(e => e.id)
        .concat([...document.querySelectorAll("a[name]")].map(e => e.name)),
    links: [...document.querySelectorAll("a[href]")].map(a => a.href),
    images: [...document.images].map(i => ({src: i.currentSrc || i.src, ok: i.complete && i.naturalWidth > 0})),
})"""


def find_chromium(given: str | None = None) -> str | None:
    """The Chromium to drive: `given`, $CHROMIUM, or the first of CANDIDATES on PATH."""
    for name in (given, os.environ.get("CHROMIUM"), *CANDIDATES):
        if name and (path := shutil.which(name)):
            return path
    return None


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


class _Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # the browser closed a page mid-transfer
            super().handle_error(request, client_address)


def serve(site: Path) -> http.server.ThreadingHTTPServer:
    """The site over http on 127.0.0.1 (a free port), from a daemon thread."""
    handler = functools.partial(_Quiet, directory=str(site))
    server = _Server(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def pages(site: Path) -> list[str]:
    """Every HTML page's path under the site, as the server serves it (a folder's index.html as the folder)."""
    out = []
    for page in sorted(site.rglob("*.html")):
        rel = page.relative_to(site).as_posix()
        out.append(rel.removesuffix("index.html") if page.name == "index.html" else rel)
    return out


def status(url: str) -> int:
    """The HTTP status of a same-site URL."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


def check(site: Path, chromium: str, tabs: int = 4) -> tuple[list[str], dict[str, int]]:
    """(the problems found, the counts of what was checked); `tabs` pages load at once."""
    import asyncio

    server = serve(site)
    base = f"http://127.0.0.1:{server.server_port}/"
    counts = {"pages": 0, "images": 0, "links": 0, "anchors": 0, "requests": 0}
    try:
        visits = asyncio.run(_visit_all(base, pages(site), chromium, tabs, counts))
        problems: list[str] = []
        ids: dict[str, set[str]] = {}  # page URL -> its ids
        links: list[tuple[str, str]] = []  # (page it is on, resolved href), same site only
        for path, seen, facts in visits:
            counts["pages"] += 1
            ids[base + path] = set(facts["ids"])
            for image in facts["images"]:
                counts["images"] += 1
                if not image["ok"]:
                    seen.append(f"image did not load: {image['src']}")
            links += [(base + path, href) for href in facts["links"] if href.startswith(base)]
            problems += [f"{path or '/'}: {what}" for what in dict.fromkeys(seen)]
        problems += _link_problems(base, links, ids, counts)
    finally:
        server.shutdown()
    return problems, counts


async def _visit_all(base: str, paths: list[str], chromium: str, tabs: int, counts: dict[str, int]) -> list:
    """[(path, what went wrong, PAGE_FACTS)] per page, each loaded in its own tab until the network is idle."""
    import asyncio

    from playwright.async_api import async_playwright

    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        context = await browser.new_context()
        free = asyncio.Semaphore(tabs)

        async def visit(path: str):
            seen: list[str] = []

            def answered(response) -> None:
                if response.url.startswith(base):
                    counts["requests"] += 1
                    if response.status >= 400:
                        seen.append(f"{response.status} for {response.url}")

            async with free:
                page = await context.new_page()
                page.on("console", lambda m: m.type == "error" and seen.append(f"console error: {m.text}"))
                page.on("pageerror", lambda e: seen.append(f"page error: {e}"))
                page.on("requestfailed", lambda r: seen.append(f"request failed: {r.url} ({r.failure})"))
                page.on("response", answered)
                response = await page.goto(base + path, wait_until="load")
                if response is None or response.status != 200:
                    seen.append(f"the page answered {response.status if response else 'nothing'}")
                await page.wait_for_load_state("networkidle")  # what scripts fetch after load (the search index)
                facts = await page.evaluate(PAGE_FACTS)
                await page.close()
            return path, seen, facts

        visits = await asyncio.gather(*(visit(path) for path in paths))
        await browser.close()
    return visits


def _link_problems(base: str, links, ids: dict[str, set[str]], counts: dict[str, int]) -> list[str]:
    """Each same-site link's target must answer 200; its #anchor must be an id of the target page."""
    problems, answers = [], {}
    for page, href in links:
        counts["links"] += 1
        target, fragment = urldefrag(href)
        if target not in answers:
            answers[target] = status(target)
        where = page.removeprefix(base) or "/"
        if answers[target] != 200:
            problems.append(f"{where}: link to {target.removeprefix(base)} answers {answers[target]}")
            continue
        if fragment:
            counts["anchors"] += 1
            page_ids = ids.get(target)
            if page_ids is None and urlsplit(target).path.endswith("/"):
                page_ids = ids.get(target + "index.html")
            if page_ids is None:
                problems.append(f"{where}: link to {href.removeprefix(base)}: an anchor into a file that is no page")
            elif unquote(fragment) not in page_ids:
                problems.append(f"{where}: link to {href.removeprefix(base)}: no element with id {unquote(fragment)!r}")
    return list(dict.fromkeys(problems))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", type=Path, help="a built site (mkdocs build --site-dir SITE)")
    parser.add_argument("--chromium", help="the Chromium executable (default: $CHROMIUM, or one on PATH)")
    args = parser.parse_args()
    chromium = find_chromium(args.chromium)
    if chromium is None:
        print(f"check_site: no Chromium found (looked for $CHROMIUM and {', '.join(CANDIDATES)} on PATH)")
        return 2
    if not (args.site / "index.html").is_file():
        print(f"check_site: {args.site} is not a built site (no index.html)")
        return 2
    problems, counts = check(args.site, chromium)
    for problem in problems:
        print(f"check_site: {problem}")
    summary = ", ".join(f"{n} {what}" for what, n in counts.items())
    print(f"check_site: {'FAILED' if problems else 'ok'}: {summary} checked in {chromium}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
