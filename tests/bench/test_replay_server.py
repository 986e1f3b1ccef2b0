"""The replay proposer (benchmarking only; an H-Spec drafter runs every round) behind vLLM's OpenAI server
on the CPU, measured by `hybridspec bench`: the acceptance length the benchmark reports is the
records' one, for each setting of the length selector switched in place."""

from __future__ import annotations

import json
import math
import shlex
import subprocess
import sys

import numpy as np
import pytest
import torch

from vllm_hybridspec.policy.records import RoundRecord, save_records

from .conftest import VOCAB, free_port, serve_command, server_env
from ..seeds import fresh_seed

HYBRIDSPEC = [sys.executable, "-m", "vllm_hybridspec.cli"]
K, D, OUTPUT_LEN = 3, 5, 48


def save_hspec_drafter(target, out):
    """A random H-Spec drafter for the 2-layer bench target: it reads layer 1's K/V and hidden input."""
    from transformers import AutoConfig

    from vllm_hybridspec.drafter import HSpecDraftModel

    torch.manual_seed(0)
    HSpecDraftModel.from_training_args(
        AutoConfig.from_pretrained(target), None, None, verifier_name_or_path=str(target), target_layer_ids=[1],
        kv_reuse_layer_ids=[1], mask_token_id=VOCAB - 1, mamba_num_heads=4, mamba_head_dim=16, markov_rank=16,
    ).save_pretrained(out)
    return out


@pytest.mark.timeout(900)
def test_bench_measures_the_replayed_acceptance(tiny_target, token_prompts, tmp_path):
    seed = fresh_seed("replay_server_bench_measures_the_replaye")
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

    hspec = save_hspec_drafter(tiny_target, tmp_path / "hspec")
    replay = {"method": "replay_bench", "model": str(hspec), "num_speculative_tokens": K, "hybridspec": {},
              "replay_bench": {"records": str(tmp_path / "rounds.jsonl"), "continuations": str(cont), "seed": seed}}
    serve = shlex.join(serve_command(tiny_target, free_port(), "--dtype", "float32",
                                     "--speculative-config", json.dumps(replay)))
    out = tmp_path / "replay.json"
    # one server, three settings of its length selector switched in place (vllm_hybridspec.engine.length.control):
    # every draft verified, two tokens per round (one draft), drafting off
    switches = ["all={}", 'w2={"fixed_length": 2}', 'off={"drafting": false}']
    run = subprocess.run([*HYBRIDSPEC, "bench", "--serve", serve, "--prompts", str(token_prompts),
                          "--concurrency", "1,4", "--num-requests", "8", "--warmup", "2",
                          "--output-len", str(OUTPUT_LEN), "-o", str(out),
                          *[a for sw in switches for a in ("--switch", sw)]],
                         env=server_env(), capture_output=True, text=True, timeout=800, check=False)
    log = (tmp_path / "replay.server.log").read_text()
    print(run.stdout, run.stderr[-2000:], sep="\n")
    assert run.returncode == 0
    assert "is not in the continuations file" not in log
    assert f"method='hspec' (vLLM path 'dflash'), model='{hspec}', num_spec_tokens={K}" in log  # served as H-Spec is
    for name, expected in (("all", np.minimum(accepted, K)), ("w2", np.minimum(accepted, 1))):
        doc = json.loads((tmp_path / f"replay-{name}.json").read_text())
        assert doc["config"]["label"] == f"replay-{name}" and doc["config"]["switch"]["label"] == name
        for lv in doc["levels"]:
            assert (lv["completed"], lv["failed"]) == (8, 0) and lv["output_tokens"] == 8 * OUTPUT_LEN
            sd = lv["spec_decode"]
            mean = sd["num_accepted_tokens"] / sd["num_drafts"]
            bound = 4 * max(expected.std(), 0.05) / math.sqrt(sd["num_drafts"])
            print(f"{name} C = {lv['concurrency']}: {sd}; accepted per draft {mean:.3f}, records "
                  f"{expected.mean():.3f} +- {bound:.3f}; acceptance length {lv['mean_acceptance_length']:.3f}")
            if name == "all":  # every draft, but never past a request's output budget (its last rounds)
                assert (K - 1) * sd["num_drafts"] < sd["num_draft_tokens"] <= K * sd["num_drafts"]
            else:  # vLLM schedules and counts all K drafts; the step verifies one (engine/length/cut.py)
                assert sd["num_draft_tokens"] == K * sd["num_drafts"]
                assert sd["num_accepted_tokens"] <= sd["num_drafts"]
            assert abs(mean - expected.mean()) < bound
            assert lv["mean_acceptance_length"] == pytest.approx(1 + mean)
    off = json.loads((tmp_path / "replay-off.json").read_text())
    for lv in off["levels"]:
        assert (lv["completed"], lv["failed"]) == (8, 0) and lv["output_tokens"] == 8 * OUTPUT_LEN
        assert lv["spec_decode"].get("num_drafts", 0) == 0, lv["spec_decode"]
    assert "switched the server to w2 = {\"fixed_length\": 2}" in run.stderr


def test_switch_options_and_refusals_name_the_bad_value(tmp_path):
    """--switch values are checked before any server starts; a server without the development endpoint,
    one that refuses an option, and one that is not there each give one clear error."""
    import http.server
    import threading

    from vllm_hybridspec.bench.server import ServerError, switch_server
    from vllm_hybridspec.engine.length.control import parse_switch_options

    assert parse_switch_options('{"policy": "p.json", "gate": false}') == {"policy": "p.json", "gate": False}
    assert parse_switch_options('{"fixed_length": 3}') == {"fixed_length": 3}
    for text, message in (('{"lenght": 3}', r"unknown switch option\(s\) \['lenght'\]"),
                          ("{fixed_length: 3}", "not JSON"),
                          ('{"drafting": "false"}', "drafting='false' must be true or false"),
                          ('{"drafting": null}', "drafting=None must be true or false"),
                          ('{"fixed_length": true}', "fixed_length=True must be an integer >= 1"),
                          ('{"fixed_length": 0}', "fixed_length=0 must be an integer >= 1"),
                          ('{"gate": false}', "gate needs a policy"),
                          ('{"batched": true}', "batched needs a policy"),
                          ('{"policy": "p.json", "fixed_length": 2}', "exclude each other")):
        with pytest.raises(ValueError, match=message):
            parse_switch_options(text)
    run = subprocess.run([*HYBRIDSPEC, "bench", "--url", "http://127.0.0.1:9", "--prompts", "/dev/null",
                          "--switch", "w 4={}", "-o", str(tmp_path / "x.json")],
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 2 and "--switch 'w 4={}'" in run.stderr
    with pytest.raises(ServerError, match="unreachable"):
        switch_server(f"http://127.0.0.1:{free_port()}", {"fixed_length": 2}, timeout=5)

    answers = {"/dev404": (404, b"{}"), "/refuses": (200, b'{"results": [{"ok": false, "error": "no such policy"}]}'),
               "/ok": (200, b'{"results": [{"ok": true, "stats": {}}]}')}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            prefix = "/" + self.path.strip("/").split("/")[0]
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert body["method"] == "hybridspec_configure" and isinstance(body["kwargs"]["options"], str)
            code, payload = answers[prefix]
            self.send_response(code)
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_port}"
    try:
        with pytest.raises(ServerError, match="has no /collective_rpc endpoint: start the server with VLLM_SERVER_DEV_MODE=1"):
            switch_server(f"{base}/dev404", {"fixed_length": 2}, timeout=5)
        with pytest.raises(ServerError, match="refused switch options .* no such policy"):
            switch_server(f"{base}/refuses", {"policy": "missing.json"}, timeout=5)
        assert switch_server(f"{base}/ok", {}, timeout=5) == [{"ok": True, "stats": {}}]
    finally:
        server.shutdown()
