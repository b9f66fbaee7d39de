"""Recipes: one YAML file describes a whole job (source, RoPE selection, factorization, adaptation,
validation); ``mla-convert run RECIPE [key=value ...]`` executes it stage by stage.

Modules, one job each: :mod:`~mla_convert.recipes.schema` (what a recipe may say, :class:`RecipeError`),
:mod:`~mla_convert.recipes.overrides` (the ``key=value`` grammar), :mod:`~mla_convert.recipes.load` (YAML with
line numbers, every problem at once, the resolved recipe), :mod:`~mla_convert.recipes.plan` (run / skip / off
per stage, cache shapes), :mod:`~mla_convert.recipes.memory` (the peak-memory estimate),
:mod:`~mla_convert.recipes.run` (the stage runner) and :mod:`~mla_convert.recipes.catalog` (the bundled
recipes, whose YAML files are the package ``mla_convert.recipes.bundled``).

Nothing is imported here: ``mla_convert.recipes.bundled`` (data) stays cheap to import.
"""
