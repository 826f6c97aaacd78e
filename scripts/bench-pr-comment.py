#!/usr/bin/env python3
"""Posts the benchmark comparison on a pull request, as one comment updated in place.

The comment carries a hidden marker; each push edits the comment that has it instead
of adding another, so a pull request shows the latest comparison once. Standard
library only (urllib against the GitHub REST API), so the workflow needs no action
from outside the repository for it. The token comes from GITHUB_TOKEN and needs
`pull-requests: write`; the workflow runs this only for pull requests from the same
repository, since a fork's token cannot write.

    scripts/bench-pr-comment.py --body compare.md --repo OWNER/NAME --pr 12
    scripts/bench-pr-comment.py --body compare.md --repo OWNER/NAME --pr 12 --dry-run

`--dry-run` (what .ci/run uses) builds the comment and prints what it would send.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.request
from pathlib import Path
from typing import Any

MARKER = "<!-- fila-bench-regression -->"
API = os.environ.get("GITHUB_API_URL", "https://api.github.com")
MAX_BODY = 65_000  # GitHub refuses comments over 65,536 characters


def comment_body(markdown: str, run_url: str | None) -> str:
    body = f"{MARKER}\n{markdown.strip()}\n"
    if run_url:
        body += f"\nResults, runs and charts: [workflow run artifacts]({run_url})\n"
    if len(body) > MAX_BODY:
        body = body[: MAX_BODY - 40] + "\n\n(truncated; see the artifacts)\n"
    return body


def _request(method: str, url: str, token: str, payload: dict[str, Any] | None = None) -> Any:
    data = json.dumps(payload).encode() if payload is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Authorization", f"Bearer {token}")
    req.add_header("Accept", "application/vnd.github+json")
    req.add_header("X-GitHub-Api-Version", "2022-11-28")
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read() or b"null")


def find_comment(repo: str, pr: int, token: str) -> int | None:
    """The id of our earlier comment on the pull request, if any (all pages)."""
    page = 1
    while True:
        url = f"{API}/repos/{repo}/issues/{pr}/comments?per_page=100&page={page}"
        comments = _request("GET", url, token)
        for comment in comments:
            if MARKER in (comment.get("body") or ""):
                return int(comment["id"])
        if len(comments) < 100:
            return None
        page += 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--body", type=Path, required=True, help="Markdown file to post")
    parser.add_argument("--repo", required=True, help="OWNER/NAME")
    parser.add_argument("--pr", type=int, required=True, help="pull request number")
    parser.add_argument("--run-url", help="link to the workflow run and its artifacts")
    parser.add_argument("--dry-run", action="store_true", help="print instead of posting")
    args = parser.parse_args()

    if not args.body.is_file():
        print(f"bench-pr-comment: {args.body} does not exist (did the comparison run?)")
        return 1
    body = comment_body(args.body.read_text(encoding="utf-8"), args.run_url)
    if args.dry_run:
        print(f"bench-pr-comment (dry run): would upsert on {args.repo}#{args.pr}:\n{body}")
        return 0
    token = os.environ.get("GITHUB_TOKEN", "")
    if not token:
        print("bench-pr-comment: GITHUB_TOKEN is not set", file=sys.stderr)
        return 1
    existing = find_comment(args.repo, args.pr, token)
    if existing is None:
        _request(
            "POST", f"{API}/repos/{args.repo}/issues/{args.pr}/comments", token, {"body": body}
        )
        print(f"bench-pr-comment: commented on {args.repo}#{args.pr}")
    else:
        _request(
            "PATCH", f"{API}/repos/{args.repo}/issues/comments/{existing}", token, {"body": body}
        )
        print(f"bench-pr-comment: updated comment {existing} on {args.repo}#{args.pr}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
