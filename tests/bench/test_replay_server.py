"""The replay proposer (benchmarking only) behind vLLM's OpenAI server on the CPU, measured by
`hybridspec bench`: the acceptance length the benchmark reports is the records' one."""

from __future__ import annotations

import json
import math
import shlex
import subprocess
import sys

import numpy as np
import pytest

from vllm_hybridspec.policy.records import RoundRecord, save_records

from .conftest import free_port, serve_command, server_env

HYBRIDSPEC = [sys.executable, "-m", "vllm_hybridspec.cli"]
K, D, OUTPUT_LEN = 3, 5, 48


@pytest.mark.timeout(900)
def test_bench_measures_the_replayed_acceptance(tiny_target, token_prompts, tmp_path):
    seed = int(np.random.SeedSequence().entropy % 2**31)
    rng = np.random.default_rng(seed)
    accepted = rng.choice(D + 1, size=300, p=[0.1, 0.1, 0.2, 0.2, 0.2, 0.2])
    save_records([RoundRecord(conf=rng.uniform(0, 1, D).tolist(), ent=rng.uniform(0, 2, D).tolist(),
                              accepted=int(a)) for a in accepted], tmp_path / "rounds.jsonl")
    pool = np.minimum(accepted, K)

    cont = tmp_path / "cont.jsonl"
    record = subprocess.run([*HYBRIDSPEC, "replay-record", "--model", str(tiny_target), "--prompts", str(token_prompts),
                             "--output-len", str(OUTPUT_LEN), "--num-speculative-tokens", str(K), "--dtype", "float32",
                             "--max-model-len", "256", "-o", str(cont), "--engine-args",
                             '{"enforce_eager": true, "skip_tokenizer_init": true}'],
                            env=server_env(), capture_output=True, text=True, timeout=600, check=False)
    assert record.returncode == 0, record.stderr[-3000:]
    assert "recorded 16 greedy continuations of 48 + 3 tokens" in record.stdout

    replay = {"method": "replay_bench", "num_speculative_tokens": K,
              "replay_bench": {"records": str(tmp_path / "rounds.jsonl"), "continuations": str(cont), "seed": seed}}
    serve = shlex.join(serve_command(tiny_target, free_port(), "--dtype", "float32",
                                     "--speculative-config", json.dumps(replay)))
    out = tmp_path / "replay.json"
    run = subprocess.run([*HYBRIDSPEC, "bench", "--serve", serve, "--prompts", str(token_prompts),
                          "--concurrency", "1,4", "--num-requests", "8", "--warmup", "2",
                          "--output-len", str(OUTPUT_LEN), "-o", str(out)],
                         env=server_env(), capture_output=True, text=True, timeout=800, check=False)
    log = (tmp_path / "replay.server.log").read_text()
    print(run.stdout, run.stderr[-2000:], sep="\n")
    assert run.returncode == 0
    assert "left its recorded greedy continuation" not in log
    doc = json.loads(out.read_text())
    for lv in doc["levels"]:
        assert (lv["completed"], lv["failed"]) == (8, 0) and lv["output_tokens"] == 8 * OUTPUT_LEN
        sd = lv["spec_decode"]
        mean = sd["num_accepted_tokens"] / sd["num_drafts"]
        bound = 4 * pool.std() / math.sqrt(sd["num_drafts"])
        print(f"C = {lv['concurrency']}: {sd}; accepted per draft {mean:.3f}, records {pool.mean():.3f} "
              f"+- {bound:.3f}; acceptance length {lv['mean_acceptance_length']:.3f}")
        assert sd["num_draft_tokens"] == K * sd["num_drafts"]
        assert abs(mean - pool.mean()) < bound
        assert lv["mean_acceptance_length"] == pytest.approx(1 + mean)
