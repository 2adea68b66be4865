"""The ``--prepack`` choices (:mod:`splitspec.models.prepack`), importable without torch: trunk and edge share them."""

from __future__ import annotations

PREPACK_CHOICES = ("auto", "on", "off")
