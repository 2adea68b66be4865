"""How reports name files: relative to a root (the working directory by default) when inside it.

Committed results must not carry one machine's absolute paths; a path outside the root is shown
as given, since no relative form would be truer.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["display_path"]


def display_path(path: str | Path, root: Path | None = None) -> str:
    """``path`` relative to ``root`` (default: the working directory) when it lies below it."""
    resolved = Path(path).resolve()
    base = (root if root is not None else Path.cwd()).resolve()
    return str(resolved.relative_to(base)) if resolved.is_relative_to(base) else str(path)
