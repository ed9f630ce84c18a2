"""Escape-time Mandelbrot counts in row bands, balanced dynamically, checked on the CPU."""

from __future__ import annotations

from .kernels import mandelbrot_axes, mandelbrot_counts
from .workload import Mandelbrot, MandelbrotOutput, MandelbrotParams, render_png, row_costs

__all__ = [
    "Mandelbrot",
    "MandelbrotOutput",
    "MandelbrotParams",
    "mandelbrot_axes",
    "mandelbrot_counts",
    "render_png",
    "row_costs",
]
