"""Line charts drawn in the terminal with braille characters (2 x 4 dots per cell).

Small and dependency-free: a chart is a list of rich Text lines, so it prints the same
braille on a terminal (in colour) and into a file or pipe (without colour).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rich.text import Text

# Colours of the first, second, ... series (a comparison overlays two runs).
COLOURS = ("cyan", "magenta", "green", "yellow")
EVAL_COLOURS = ("yellow", "green")  # eval tau of the first, second run, beside their tau~
_DOT_BITS = ((0x01, 0x08), (0x02, 0x10), (0x04, 0x20), (0x40, 0x80))  # [row][column]
LABEL_WIDTH = 8


@dataclass
class Series:
    xs: list[float]
    ys: list[float]
    colour: str = COLOURS[0]


def compact(value: float, digits: int = 3) -> str:
    """`5.76`, `0.0123`, `12.3k`, `4.1M`: a number in a few characters (`digits`
    significant ones)."""
    if not math.isfinite(value):
        return str(value)
    size = abs(value)
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if size >= scale:
            return f"{value / scale:.{digits}g}{unit}"
    if size and size < 0.01:
        return f"{value:.{digits - 2}e}"
    return f"{value:.{digits}g}"


def chart(series: list[Series], *, width: int = 60, height: int = 6) -> list[Text]:
    """The series drawn into `width` x `height` cells, with the y range on the left and
    the x range below. Points are joined by straight lines; empty series are skipped."""
    points = [(x, y) for s in series for x, y in zip(s.xs, s.ys, strict=True)]
    if not points:
        return [Text("(no data)", style="dim")]
    x_lo, x_hi = min(p[0] for p in points), max(p[0] for p in points)
    y_lo, y_hi = min(p[1] for p in points), max(p[1] for p in points)
    if y_hi == y_lo:  # a flat line sits in the middle
        y_lo, y_hi = y_lo - 0.5 * (abs(y_lo) or 1), y_hi + 0.5 * (abs(y_hi) or 1)
    dots_w, dots_h = 2 * width, 4 * height
    bits = [[0] * width for _ in range(height)]
    owner: list[list[str | None]] = [[None] * width for _ in range(height)]

    def to_dot(x: float, y: float) -> tuple[int, int]:
        col = 0 if x_hi == x_lo else round((x - x_lo) / (x_hi - x_lo) * (dots_w - 1))
        row = round((y_hi - y) / (y_hi - y_lo) * (dots_h - 1))
        return col, row

    def plot(col: int, row: int, colour: str) -> None:
        cell_row, cell_col = row // 4, col // 2
        bits[cell_row][cell_col] |= _DOT_BITS[row % 4][col % 2]
        owner[cell_row][cell_col] = colour

    for s in series:
        dots = [to_dot(x, y) for x, y in zip(s.xs, s.ys, strict=True)]
        for i, (col, row) in enumerate(dots):
            plot(col, row, s.colour)
            if i:
                for c, r in _segment(dots[i - 1], (col, row)):
                    plot(c, r, s.colour)

    lines = []
    for r in range(height):
        label = compact(y_hi) if r == 0 else compact(y_lo) if r == height - 1 else ""
        line = Text(label.rjust(LABEL_WIDTH - 1) + " ", style="dim")
        line.append("│" if 0 < r < height - 1 else "┤", style="dim")
        for c in range(width):
            line.append(chr(0x2800 + bits[r][c]), style=owner[r][c] or "")
        lines.append(line)
    left, right = f"{x_lo:g}", f"{x_hi:g}"
    axis = " " * LABEL_WIDTH + "└" + "─" * width
    lines.append(Text(axis, style="dim"))
    room = max(1, width + 1 - len(left) - len(right))
    lines.append(Text(" " * (LABEL_WIDTH + 1) + left + " " * room + right, style="dim"))
    return lines


def _segment(a: tuple[int, int], b: tuple[int, int]) -> list[tuple[int, int]]:
    """The dots between a and b (a straight line, both ends left out)."""
    (c0, r0), (c1, r1) = a, b
    n = max(abs(c1 - c0), abs(r1 - r0))
    return [(round(c0 + (c1 - c0) * i / n), round(r0 + (r1 - r0) * i / n)) for i in range(1, n)]
