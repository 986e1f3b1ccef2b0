"""Round records: JSONL round trip and rejection of malformed lines with line and field."""

import json

import pytest
import torch

from vllm_hybridspec.policy import InputError, RoundRecord, Rounds, load_records, save_records


def write_lines(path, objs):
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs))


def good(**over):
    rec = {"conf": [0.9, 0.5, 0.2], "ent": [0.1, 1.0, 2.0], "accepted": 1, "truncated": False}
    rec.update(over)
    return rec


def test_round_trip(tmp_path):
    gen = torch.Generator().manual_seed(11)
    recs = []
    for r in range(20):
        conf = torch.rand(4, generator=gen).tolist()
        recs.append(RoundRecord(
            conf=conf, ent=(3 * torch.rand(4, generator=gen)).tolist(),
            accepted=int(torch.randint(0, 5, (1,), generator=gen)), truncated=r % 7 == 0,
            n_new_l0=torch.randint(0, 9, (4,), generator=gen).tolist(),
            n_new_later=torch.randint(0, 90, (4,), generator=gen).tolist() if r % 2 else None,
            remaining=int(torch.randint(1, 300, (1,), generator=gen))))
    save_records(recs, tmp_path / "r.jsonl")
    back = load_records(tmp_path / "r.jsonl")
    assert back == recs
    save_records(recs, tmp_path / "r.jsonl.gz")
    assert (tmp_path / "r.jsonl.gz").read_bytes()[:2] == b"\x1f\x8b"  # gzip magic
    assert load_records(tmp_path / "r.jsonl.gz") == recs
    t = Rounds.from_records(back)
    assert t.conf.shape == (20, 4) and t.draft_len == 4
    assert torch.equal(t.accepted, torch.tensor([r.accepted for r in recs]))
    assert (t.n_new_later[::2] == -1).all() and (t.n_new_later[1::2] >= 0).all()
    assert torch.equal(t.length_limit(), torch.tensor([r.remaining for r in recs]).clamp(2, 5))


@pytest.mark.parametrize("bad,where,words", [
    ("{not json", "line 2", ["not valid JSON"]),
    ("[1, 2]", "line 2", ["expected a JSON object"]),
    (good(accepted=4), "line 2", ["'accepted' is 4", "0..3"]),
    (good(conf=[0.9, 1.5, 0.2]), "line 2", ["'conf[1]'", "less than or equal to 1", "1.5"]),
    (good(ent=[0.1, -1.0, 2.0]), "line 2", ["'ent[1]'", "greater than or equal to 0", "-1.0"]),
    (good(ent=[0.1, 30.0, 2.0]), "line 2", ["'ent[1]'", "less than or equal to 27.7", "30.0"]),
    (good(ent=[0.1, 1.0]), "line 2", ["'ent' has 2 entries", "'conf' has 3"]),
    ({"conf": [0.9, 0.5, 0.2], "ent": [0.1, 1.0, 2.0]}, "line 2", ["'accepted' is missing"]),
    (good(accepted=1.5), "line 2", ["'accepted'", "integer", "1.5"]),
    (good(truncated="no"), "line 2", ["'truncated'", "boolean"]),
    (good(n_new_l0=[1, -2, 0]), "line 2", ["'n_new_l0[1]'", "greater than or equal to 0", "-2"]),
    (good(n_new_l0=[1, 1025, 0]), "line 2", ["'n_new_l0[1]'", "less than or equal to 1024", "1025"]),
    (good(acepted=1), "line 2", ["field 'acepted': unknown key (did you mean 'accepted'?); valid keys here: conf, ent"]),
    (good(conf=[0.9, 0.5], ent=[0.1, 0.2]), "line 2", ["has 2 entries", "D = 3"]),
    (good(p_true=[0.5, 0.6, 0.1]), "line 2", ["'p_true' must be non-increasing"]),
    (good(conf=[0.9, "0.5", 0.2]), "line 2", ["'conf[1]'", "valid number", "'0.5'"]),
    ('{"conf": [0.9, 0.5, 0.2], "ent": [0.1, NaN, 2.0], "accepted": 1}', "line 2", ["'ent[1]'", "finite", "nan"]),
    (good(accepted=True), "line 2", ["'accepted'", "valid integer", "True"]),
    (good(remaining=0), "line 2", ["'remaining'", "greater than or equal to 1"]),
    (good(n_new_l0=[1.0, 2, 0]), "line 2", ["'n_new_l0[0]'", "valid integer", "1.0"]),
    (good(request="7"), "line 2", ["'request'", "valid integer", "'7'"]),
])
def test_malformed_line_is_named(tmp_path, bad, where, words):
    path = tmp_path / "r.jsonl"
    write_lines(path, [good(), bad])
    with pytest.raises(InputError) as e:
        load_records(path)
    msg = str(e.value)
    assert f"{path} {where}" in msg, msg
    for w in words:
        assert w in msg, msg


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        load_records(tmp_path / "nope.jsonl")
    (tmp_path / "e.jsonl").write_text("\n\n")
    with pytest.raises(InputError, match="holds no rounds"):
        load_records(tmp_path / "e.jsonl")
