"""The bundled recipes: the repository's top-level ``recipes/*.yaml``, installed as the package
``mla_convert.recipes.bundled`` (``mla-convert init-recipe`` copies one; ``run NAME`` runs one by name), and the
``accelerate`` launch configurations of ``recipes/accelerate/`` (``init-recipe accelerate-fsdp`` copies one; they
are not recipes and ``run`` does not take them)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import yaml

#: Folder of the bundled recipe files.
BUNDLED_DIR = Path(str(resources.files("mla_convert.recipes.bundled")))


def bundled_names() -> list[str]:
    """Names of the bundled recipes (file stems), sorted."""
    return sorted(p.stem for p in BUNDLED_DIR.glob("*.yaml"))


def bundled_path(name: str) -> Path | None:
    """The bundled recipe file for ``name`` (with or without ``.yaml``), or None when there is none."""
    stem = name[:-5] if name.endswith(".yaml") else name
    p = BUNDLED_DIR / f"{stem}.yaml"
    return p if stem and "/" not in stem and p.is_file() else None


def accelerate_configs() -> dict[str, Path]:
    """``{"accelerate-NAME": path}`` of the bundled ``accelerate`` configurations (``recipes/accelerate/NAME.yaml``,
    e.g. ``accelerate-fsdp``), for ``accelerate launch --config_file``."""
    return {f"accelerate-{p.stem}": p for p in sorted((BUNDLED_DIR / "accelerate").glob("*.yaml"))}


def bundled_description(name: str) -> str:
    """The ``description`` of a bundled recipe ("" when it has none or does not parse)."""
    p = bundled_path(name)
    try:
        raw = yaml.safe_load(p.read_text()) if p else None
    except yaml.YAMLError:
        return ""
    return str(raw.get("description", "")) if isinstance(raw, dict) else ""
