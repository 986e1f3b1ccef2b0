"""Drafter training: ``hybridspec train --config recipe.yaml``.

``recipe`` (the YAML schema), ``run`` (the pipeline), ``data`` (target-generated data in speculators'
format), ``target`` (capture and K/V recomputation), ``trainer`` (speculators' trainer on any
device), ``tiny_target`` (random-weight targets for tests and examples). See docs/drafter.md.
"""
