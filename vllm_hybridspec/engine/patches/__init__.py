"""Every reach of the plugin into vLLM: the table (``table``), its installer (``install``) and the
checks that hold it to the code and to vLLM (``audit``)."""

from vllm_hybridspec.engine.patches.audit import (apply_what_fits, attribute_writes, check_row, docs_table,
                                                  is_applied, reaches_in_vllm, site_writes)
from vllm_hybridspec.engine.patches.install import apply, apply_row, original_of, params_match, resolve, wrap_once
from vllm_hybridspec.engine.patches.table import KINDS, PATCHES, WHEN, Reach, rows

__all__ = ["KINDS", "PATCHES", "WHEN", "Reach", "apply", "apply_row", "apply_what_fits", "attribute_writes",
           "check_row", "docs_table", "is_applied", "original_of", "params_match", "reaches_in_vllm", "resolve",
           "rows", "site_writes", "wrap_once"]
