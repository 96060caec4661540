"""A run's certified loss curve as one inline SVG element: no script, no external asset.

Pure function from the curve's points (``core.curve.LossCurve.to_list``: version, tokens, eval
loss) to markup the bootstrap's page embeds. x is the tokens the chain merged (versions when no
tokens were counted), y the eval loss; the axes are labelled with their ends. Every number is
formatted here from floats and ints, never copied from text, and the run label is escaped.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import Any

WIDTH, HEIGHT = 520, 180
LEFT, RIGHT, TOP, BOTTOM = 56, 12, 12, 34  # margins: room for the axis labels


def _span(values: Sequence[float]) -> tuple[float, float]:
    lo, hi = min(values), max(values)
    if hi - lo < 1e-12:  # one point, or a flat curve: centre it
        return lo - 0.5, hi + 0.5
    pad = 0.05 * (hi - lo)
    return lo - pad, hi + pad


def _tokens(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def curve_svg(points: Sequence[dict[str, Any]], label: str) -> str:
    """The SVG of ``points`` (at least one; oldest first), titled ``label`` (escaped)."""
    if not points:
        raise ValueError("a curve needs at least one point")
    by_tokens = points[-1]["tokens"] > points[0]["tokens"]
    xs = [float(p["tokens"] if by_tokens else p["version"]) for p in points]
    ys = [float(p["eval_loss"]) for p in points]
    if not all(math.isfinite(v) for v in xs + ys):
        raise ValueError("curve values must be finite")
    (x0, x1), (y0, y1) = _span(xs), _span(ys)
    w, h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def at(x: float, y: float) -> str:
        return f"{LEFT + w * (x - x0) / (x1 - x0):.1f},{TOP + h * (y1 - y) / (y1 - y0):.1f}"

    path = " ".join(at(x, y) for x, y in zip(xs, ys, strict=True))
    first, last = points[0], points[-1]
    x_name = "tokens" if by_tokens else "version"
    x_lo, x_hi = (
        (_tokens(xs[0]), _tokens(xs[-1])) if by_tokens else (f"{xs[0]:.0f}", f"{xs[-1]:.0f}")
    )
    bottom = HEIGHT - BOTTOM
    title = (
        f"{label}: certified eval loss {ys[0]:.4f} at version {first['version']} → "
        f"{ys[-1]:.4f} at version {last['version']} ({len(points)} points)"
    )
    return "".join(
        [
            f'<svg xmlns="http://www.w3.org/2000/svg" class="curve" width="{WIDTH}" '
            f'height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" role="img">',
            f"<title>{html.escape(title, quote=True)}</title>",
            f'<rect x="{LEFT}" y="{TOP}" width="{w}" height="{h}" fill="none" stroke="#ccc"/>',
            f'<polyline fill="none" stroke="#1f6feb" stroke-width="1.5" points="{path}"/>',
            f'<circle r="3" fill="#1f6feb" cx="{at(xs[-1], ys[-1]).split(",")[0]}" '
            f'cy="{at(xs[-1], ys[-1]).split(",")[1]}"/>',
            f'<text x="{LEFT - 4}" y="{TOP + 10}" text-anchor="end" font-size="11">'
            f"{max(ys):.3f}</text>",
            f'<text x="{LEFT - 4}" y="{bottom}" text-anchor="end" font-size="11">'
            f"{min(ys):.3f}</text>",
            f'<text x="{LEFT}" y="{bottom + 14}" font-size="11">{x_lo}</text>',
            f'<text x="{LEFT + w}" y="{bottom + 14}" text-anchor="end" font-size="11">'
            f"{x_hi}</text>",
            f'<text x="{LEFT + w / 2:.0f}" y="{bottom + 28}" text-anchor="middle" '
            f'font-size="11">{x_name}</text>',
            "</svg>",
        ]
    )
