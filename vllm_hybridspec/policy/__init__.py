"""Throughput-aware verification length (HybridSpec): pure torch, no vLLM import.

Data flows: capture-run ``records`` and a cost file -> ``calibrate`` (``acceptance``, ``cost``,
``rate``) -> a ``policy_file`` -> per round, ``selector`` on device; ``simulate`` replays records.
"""

from .acceptance import AcceptanceModel, acceptance_model, fit_acceptance
from .calibrate import fit_policy
from .cost import CostFile, cost_curve, expert_tables, load_costs
from .errors import InputError
from .policy_file import Policy, PolicyFile, load_policy, save_policy
from .rate import dinkelbach
from .records import RoundRecord, Rounds, load_records, save_records
from .selector import (expected_tokens, new_expert_counts, new_experts_at, routing_correction,
                       select_length, select_shared_length, stage0_length)
from .simulate import simulate, simulate_batched

__all__ = [
    "AcceptanceModel", "CostFile", "InputError", "Policy", "PolicyFile", "RoundRecord", "Rounds",
    "acceptance_model", "cost_curve", "dinkelbach", "expected_tokens", "expert_tables",
    "fit_acceptance", "fit_policy", "load_costs", "load_policy", "load_records",
    "new_expert_counts", "new_experts_at", "routing_correction", "save_policy", "save_records",
    "select_length", "select_shared_length", "simulate", "simulate_batched", "stage0_length",
]
