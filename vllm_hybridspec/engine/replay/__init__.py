"""Replayed acceptance, for benchmarking only: an H-Spec proposer that runs its drafter every round and
then proposes the target's own recorded greedy continuation, corrupted at a rejection point drawn from
recorded rounds, so a full-size target with dummy weights is measured at a real drafter's acceptance
(``docs/bench.md``). It patches nothing of its own: it is served through the drafting feature's route
(vLLM's "dflash" method; ``RunnerDFlashProposer.__new__`` builds the replay proposer)."""

