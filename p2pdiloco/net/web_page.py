"""The bootstrap's read-only web page (``GET /``): a pure function from the ``/api/v1/state``
dict to one HTML document.

Plain HTML with a little inline CSS: no build step, no script, no external asset. Every value
from the state goes through ``html.escape`` (run names, islands and addresses come from peers),
and the page refreshes itself every 10 s with a ``meta`` tag.
"""

from __future__ import annotations

import html
import time
from collections.abc import Iterable, Sequence
from typing import Any

from p2pdiloco.net.svg_curve import curve_svg

_CSS = (
    "body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}"
    "table{border-collapse:collapse;margin-bottom:1.5em}"
    "th,td{border-bottom:1px solid #ddd;padding:.25em .75em;text-align:left}"
    "td.n{text-align:right;font-variant-numeric:tabular-nums}"
    "code{font-size:.9em}.dim{color:#777}"
)


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _table(table_id: str, head: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    numeric = {
        "peers",
        "certified",
        "says version",
        "tokens/s",
        "rank",
        "accepted",
        "tokens",
        "share",
        "seen",
    }
    out = [f'<table id="{table_id}"><thead><tr>']
    out += [f"<th>{_e(h)}</th>" for h in head]
    out.append("</tr></thead><tbody>")
    for row in rows:
        cells = (
            f'<td class="n">{_e(v)}</td>' if h in numeric else f"<td>{_e(v)}</td>"
            for h, v in zip(head, row, strict=True)
        )
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _stalled(run: dict[str, Any]) -> str:
    return f"stalled: {run['stalled']}" if run.get("stalled") else ""


def _curves(curves: dict[str, list[dict[str, Any]]], names: dict[str, str]) -> list[str]:
    """The "Loss curves" section: each run's certified eval loss over tokens, as inline SVG
    (``net.svg_curve``), from its verified chain (ADR 0059); nothing for runs without one."""
    drawn = {run: points for run, points in curves.items() if points}
    if not drawn:
        return []
    parts = [
        "<h2>Loss curves</h2>",
        '<p class="dim">Eval loss on each run\'s held-out batches, as its committees certified '
        "it, over the tokens the verified chain merged (<code>p2pdiloco status --curve</code>)."
        "</p>",
    ]
    for run_id, points in drawn.items():
        name = names.get(run_id, run_id[:12])
        last = points[-1]
        parts.append(
            f'<figure id="curve-{_e(run_id[:12])}">{curve_svg(points, name)}'
            f"<figcaption>{_e(name)}: eval loss {last['eval_loss']:.4f} at version "
            f"{last['version']} ({last['tokens']:,} tokens)</figcaption></figure>"
        )
    return parts


def render_page(state: dict[str, Any]) -> str:
    """The whole page for one state snapshot (see ``NetworkState.to_dict`` and the bootstrap's
    additions: ``server``, ``leaderboards``, ``curves``)."""
    server = state.get("server", {})
    runs = state.get("runs", [])
    peers = state.get("peers", [])
    names = {r["run_id"]: r.get("name", "?") for r in runs}
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta http-equiv="refresh" content="10">',
        "<title>p2pdiloco bootstrap</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>p2pdiloco network</h1>",
        f'<p class="dim">bootstrap <code>{_e(server.get("peer_id", "?"))}</code> · version '
        f"{_e(server.get('version', '?'))} · up {_e(server.get('uptime_s', 0))} s · "
        f"{len(state.get('bootstraps', []))} bootstrap server(s) alive · "
        f"{_e(time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(state.get('time', 0))))} UTC · "
        '<a href="/api/v1/state">JSON</a></p>',
        f"<h2>Runs ({len(runs)})</h2>",
        _table(
            "runs",
            ("run", "name", "model", "peers", "certified", "tokens/s", "note"),
            (
                (
                    r["run_id"][:12],
                    r.get("name", "?"),
                    r.get("model", "?"),
                    r.get("peers", 0),
                    r.get("certified_version", 0),
                    f"{r.get('throughput_tps', 0.0):.0f}",
                    r.get("incompatible") or _stalled(r),
                )
                for r in runs
            ),
        ),
        *_curves(state.get("curves", {}), names),
        f"<h2>Peers ({len(peers)})</h2>",
        _table(
            "peers",
            ("peer", "run", "roles", "island", "reach", "says version", "tokens/s", "seen"),
            (
                (
                    "…" + p["peer_id"][-8:],
                    names.get(p["run_id"], p["run_id"][:12]),
                    ", ".join(p.get("roles", [])),
                    p.get("island", ""),
                    p.get("reachability", ""),
                    p.get("version", 0),
                    f"{p.get('throughput_tps', 0.0):.0f}",
                    f"{p.get('last_seen_s', 0):.0f} s ago",
                )
                for p in peers
            ),
        ),
        "<h2>Leaderboard</h2>",
        '<p class="dim">Receipts of each run\'s certificate chain, verified from genesis as '
        "<code>p2pdiloco status --leaderboard</code> does: a certificate counts only once it "
        "follows the elected committee's previous one.</p>",
    ]
    boards = state.get("leaderboards", {})
    for run_id, board in boards.items():
        parts.append(f"<h3>{_e(names.get(run_id, run_id[:12]))}</h3>")
        parts.append(
            _table(
                f"leaderboard-{_e(run_id[:12])}",
                ("rank", "peer", "accepted", "tokens", "share"),
                (
                    (
                        b["rank"],
                        "…" + b["peer_id"][-8:],
                        b["accepted"],
                        f"{b['tokens']:,}",
                        f"{100 * b['share']:.1f}%",
                    )
                    for b in board
                ),
            )
        )
    if not boards:
        parts.append("<p>no certificate seen yet</p>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
