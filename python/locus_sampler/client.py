"""The one call the sampler makes: ``POST /v1/assign`` on the metadata service's HTTP
port (standard library only, so the package has no dependencies)."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from typing import Any, Dict, List, Optional


class LocusUnavailable(Exception):
    """Locus could not be asked (unreachable, refused, or a bad answer)."""


def assign(
    url: str,
    dataset: str,
    rank_nodes: List[str],
    token: Optional[str] = None,
    timeout: float = 10.0,
) -> Dict[str, Any]:
    """Which shards each rank should read, with every shard's files.

    ``url`` is the metadata service's HTTP address (``http://meta:7401``), or the HTTP
    addresses of a replicated group's members, comma-separated: they are asked in turn
    until one answers (a member that is down or answers 502/503/504 is passed over)."""
    urls = [u.strip() for u in url.split(",") if u.strip()]
    if not urls:
        raise LocusUnavailable(f"{url!r}: no metadata URL")
    failures = []
    for u in urls:
        try:
            return _assign_one(u, dataset, rank_nodes, token, timeout)
        except _TryNext as e:
            failures.append(str(e))
    raise LocusUnavailable("; ".join(failures))


class _TryNext(LocusUnavailable):
    """This member could not answer; another may."""


def _assign_one(
    url: str,
    dataset: str,
    rank_nodes: List[str],
    token: Optional[str],
    timeout: float,
) -> Dict[str, Any]:
    body = json.dumps({"dataset": dataset, "rank_nodes": rank_nodes, "files": True}).encode()
    req = urllib.request.Request(
        url.rstrip("/") + "/v1/assign",
        data=body,
        headers={"content-type": "application/json"},
        method="POST",
    )
    token = token if token is not None else os.environ.get("LOCUS_TOKEN")
    if token:
        req.add_header("authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            answer = json.load(resp)
    except urllib.error.HTTPError as e:
        try:
            why = json.load(e).get("error", "")
        except Exception:  # noqa: BLE001 - the status alone is reason enough
            why = ""
        error = _TryNext if e.code in (502, 503, 504) else LocusUnavailable
        raise error(f"{url}: HTTP {e.code} {why}".strip()) from e
    except (urllib.error.URLError, OSError) as e:
        raise _TryNext(f"{url}: {e}") from e
    except ValueError as e:
        raise LocusUnavailable(f"{url}: {e}") from e
    if not isinstance(answer, dict) or "ranks" not in answer or "shards" not in answer:
        raise LocusUnavailable(f"{url}: not an assign answer")
    return answer
