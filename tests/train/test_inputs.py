"""``hybridspec train`` on bad input: exit status 2, one line on stderr naming the file, the field, the
value and what would be valid, and nothing written (no output folder, no temporary file). Then the
writers: a run that fails midway leaves whole artifacts only and a ``run.json`` saying so, and a rerun
reuses what it can."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

import vllm_hybridspec.drafter  # noqa: F401  (its import-time warnings fire here, not inside a command)
from vllm_hybridspec.cli import app

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hspec_recipe.yaml"
PROMPTS = EXAMPLE.parent / "hspec_prompts.jsonl"


def recipe_dict(tmp_path: Path) -> dict:
    """The example recipe, small, writing to ``tmp_path/run``."""
    recipe = yaml.safe_load(EXAMPLE.read_text())
    recipe["output_dir"] = str(tmp_path / "run")
    recipe["data"].update(prompts=str(PROMPTS), max_prompts=4, max_new_tokens=8, generation_batch_size=4,
                          val_fraction=0.25)
    recipe["training"].update(epochs=1, total_seq_len=256, max_anchors=8)
    return recipe


def write_recipe(tmp_path: Path, recipe: dict | str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe if isinstance(recipe, str) else yaml.safe_dump(recipe))
    return path


def train(*args) -> object:
    return CliRunner().invoke(app, ["train", *map(str, args)])


def refused_line(result) -> str:
    """The one error line of a refused command (exit 2, no traceback)."""
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.output
    assert lines[0].startswith("hybridspec train: error: "), lines[0]
    return lines[0].removeprefix("hybridspec train: error: ")


def set_key(recipe: dict, dotted: str, value) -> dict:
    *head, last = dotted.split(".")
    node = recipe
    for key in head:
        node = node.setdefault(key, {})
    node[last] = value
    return recipe


def drop_key(recipe: dict, dotted: str) -> dict:
    *head, last = dotted.split(".")
    node = recipe
    for key in head:
        node = node[key]
    del node[last]
    return recipe


VALID_DATA_KEYS = ("prompts, split, prompt_field, max_prompts, max_prompt_tokens, max_new_tokens, temperature, "
                   "top_p, generation_batch_size, val_fraction")

# (a dotted key of the recipe, its bad value, the message after "<recipe file>: ")
BAD_VALUES = [
    ("data.max_promts", 32, f"field 'data.max_promts': unknown key (did you mean 'max_prompts'?); valid keys "
                            f"here: {VALID_DATA_KEYS}"),
    ("training.epoch", 2, "field 'training.epoch': unknown key (did you mean 'epochs'?); valid keys here: epochs, "
                          "max_steps, lr, weight_decay, scheduler, warmup_ratio, total_seq_len, max_anchors, loss_fn, "
                          "loss_implementation, decay_gamma, device, dtype, checkpoint_freq, log_freq, num_workers, "
                          "resume"),
    ("training.epochs", 0, "field 'training.epochs': Input should be greater than or equal to 1 (got 0)"),
    ("training.epochs", -3, "field 'training.epochs': Input should be greater than or equal to 1 (got -3)"),
    ("training.epochs", "2", "field 'training.epochs': Input should be a valid integer (got '2')"),
    ("training.epochs", 1.5, "field 'training.epochs': Input should be a valid integer (got 1.5)"),
    ("training.max_steps", 0, "field 'training.max_steps': Input should be greater than or equal to 1 (got 0)"),
    ("training.lr", 0.0, "field 'training.lr': Input should be greater than 0 (got 0.0)"),
    ("training.lr", float("nan"), "field 'training.lr': Input should be a finite number (got nan)"),
    ("training.warmup_ratio", 1.0, "field 'training.warmup_ratio': Input should be less than 1 (got 1.0)"),
    ("training.resume", "yes", "field 'training.resume': Input should be a valid boolean (got 'yes')"),
    ("training.scheduler", "cosin", "field 'training.scheduler': Input should be 'cosine', 'linear' or 'none' "
                                    "(got 'cosin')"),
    ("training.device", "gpu", "field 'training.device': 'gpu' is not a device; use auto, cpu, cuda or cuda:N"),
    ("training.loss_fn", '{"ce": 0.1, "tvv": 0.9}', "field 'training.loss_fn': Unknown loss function 'tvv' in "
                                                    "loss config. Choose from: ['ce', 'jsd', 'kl_div', 'lk_hybrid', "
                                                    "'nla', 'rkl', 'tv']"),
    ("training.loss_fn", '{"ce": -1}', "field 'training.loss_fn': loss weights must be finite, >= 0 and not all 0, "
                                       "got {'ce': -1}"),
    ("seed", -1, "field 'seed': Input should be greater than or equal to 0 (got -1)"),
    ("data.val_fraction", 0, "field 'data.val_fraction': Input should be greater than 0 (got 0)"),
    ("data.top_p", 1.5, "field 'data.top_p': Input should be less than or equal to 1 (got 1.5)"),
    ("data.temperature", -0.5, "field 'data.temperature': Input should be greater than or equal to 0 (got -0.5)"),
    ("data.max_new_tokens", 0, "field 'data.max_new_tokens': Input should be greater than or equal to 1 (got 0)"),
    ("drafter.type", "eagle", "field 'drafter.type': Input should be 'hspec' or 'dflash' (got 'eagle')"),
    ("drafter.block_size", 1, "field 'drafter.block_size': Input should be greater than or equal to 2 (got 1)"),
    ("drafter.target_layer_ids", [1, 1, 2], "field 'drafter.target_layer_ids': layer indices must be distinct and "
                                            ">= 0, got [1, 1, 2]"),
    ("drafter.target_layer_ids", [1, 2, 9], "field 'drafter.target_layer_ids': [1, 2, 9]: layer 9 does not exist; "
                                            "the target has 6 layers (0..5)"),
    ("target.tiny.num_key_value_heads", 3, "field 'target.tiny': num_attention_heads = 4 is not a multiple of "
                                           "num_key_value_heads = 3"),
    ("target.tiny.model_type", "llama", "field 'target.tiny.model_type': Input should be 'qwen3' or 'qwen3_next' "
                                        "(got 'llama')"),
    ("target.name_or_path", "/no/such/model", "field 'target': set exactly one of name_or_path and tiny, got both"),
    ("output_dir", "", "field 'output_dir': String should have at least 1 character (got '')"),
]


@pytest.mark.parametrize("key, value, message", BAD_VALUES, ids=[f"{k}={v!r}" for k, v, _ in BAD_VALUES])
def test_a_bad_recipe_value_is_one_line_and_nothing_is_written(tmp_path, key, value, message):
    config = write_recipe(tmp_path, set_key(recipe_dict(tmp_path), key, value))
    assert refused_line(train("--config", config)) == f"{config}: {message}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml"]


def test_the_name_or_path_target_is_checked_before_anything_is_written(tmp_path):
    recipe = drop_key(recipe_dict(tmp_path), "target.tiny")
    recipe["target"]["name_or_path"] = str(tmp_path / "no-model")
    config = write_recipe(tmp_path, recipe)
    assert refused_line(train("--config", config)) == (
        f"{config}: field 'target.name_or_path': '{tmp_path / 'no-model'}' does not exist; expected a transformers "
        "model directory (with config.json) or a hub model id")
    (tmp_path / "no-model").mkdir()
    assert refused_line(train("--config", config)) == (
        f"{config}: field 'target.name_or_path': '{tmp_path / 'no-model'}' has no config.json; expected a "
        "transformers model directory or a hub model id")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["no-model", "recipe.yaml"]


def test_layers_are_checked_against_the_target(tmp_path):
    """A tiny Qwen3-Next has full attention every other layer (1, 3, 5): K/V of a GDN layer cannot be
    reused, and reused layers must be selected ones."""
    recipe = recipe_dict(tmp_path)
    recipe["target"]["tiny"]["model_type"] = "qwen3_next"
    recipe["drafter"].update(target_layer_ids=[1, 2, 3], kv_reuse_layer_ids=[2, 3])
    config = write_recipe(tmp_path, recipe)
    assert refused_line(train("--config", config)) == (
        f"{config}: field 'drafter': kv_reuse_layer_ids [2, 3]: target layers [2] are not full-attention layers; "
        "the target's full-attention layers are [1, 3, 5]")
    recipe["drafter"].update(target_layer_ids=[1, 2], kv_reuse_layer_ids=[1, 3])
    config = write_recipe(tmp_path, recipe)
    assert refused_line(train("--config", config)) == (
        f"{config}: drafter.kv_reuse_layer_ids [1, 3]: layers [3] are not in "
        "drafter.target_layer_ids [1, 2]; the drafter reads K/V only of selected layers")
    recipe["drafter"].update(target_layer_ids=None, kv_reuse_layer_ids=None, mask_token_id=10**6)
    config = write_recipe(tmp_path, recipe)
    assert refused_line(train("--config", config)) == (
        f"{config}: field 'drafter.mask_token_id': 1000000 is outside the target's vocabulary of 264 tokens; "
        "give at most 263")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml"]


@pytest.mark.parametrize("text, message", [
    ("seed: 0\noutput_dir: [unclosed\n",
     "not valid YAML (expected ',' or ']', but got '<stream end>' at line 3, column 1)"),
    ("seed: 0\nseed: 1\n", "not valid YAML (key 'seed' appears twice (first at line 1) at line 2, column 1)"),
    ("- a\n- b\n", "a recipe is a YAML mapping with keys seed, output_dir, target, data, drafter, training, got list"),
    ("", "a recipe is a YAML mapping with keys seed, output_dir, target, data, drafter, training, got an empty file"),
    ("seed: 0\n", "required field 'output_dir' is missing (and 2 more problems)"),
])
def test_a_recipe_that_is_not_a_recipe_is_one_line(tmp_path, text, message):
    config = write_recipe(tmp_path, text)
    assert refused_line(train("--config", config)) == f"{config}: {message}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml"]


def test_recipe_files_that_cannot_be_read(tmp_path):
    assert refused_line(train("--config", tmp_path / "none.yaml")) == f"recipe '{tmp_path / 'none.yaml'}' does not exist"
    assert refused_line(train("--config", tmp_path)) == f"recipe '{tmp_path}' is a directory; give a YAML file"
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(bytes(range(128, 256)))
    assert refused_line(train("--config", binary)) == f"{binary}: not UTF-8 text; expected a recipe in YAML"


def test_an_exponent_without_a_dot_is_a_number(tmp_path):
    """PyYAML (YAML 1.1) reads ``6e-4`` as text; the recipe loader reads it as YAML 1.2 does."""
    from vllm_hybridspec.train.recipe import Recipe

    text = yaml.safe_dump(recipe_dict(tmp_path)).replace("lr: 0.0006", "lr: 6e-4")
    assert "lr: 6e-4" in text
    assert Recipe.from_yaml(write_recipe(tmp_path, text)).training.lr == 6e-4


def test_prompts_files_are_checked_before_anything_is_written(tmp_path):
    recipe = recipe_dict(tmp_path)
    config = tmp_path / "recipe.yaml"
    field = "field 'data.prompts'"

    def refusal(prompts, **data) -> str:
        recipe["data"].update(prompts=str(prompts), **data)
        write_recipe(tmp_path, recipe)
        return refused_line(train("--config", config)).removeprefix(f"{config}: ")

    missing = tmp_path / "missing.jsonl"
    assert refusal(missing) == (f"{field}: '{missing}' does not exist; expected a .jsonl/.json/.parquet file, a "
                                "save_to_disk directory or a Hugging Face hub dataset name")
    folder = tmp_path / "folder"
    folder.mkdir()
    assert refusal(folder) == (f"{field}: '{folder}' is a directory without datasets' save_to_disk files "
                               "(dataset_info.json, state.json, dataset_dict.json); give a .jsonl/.json/.parquet "
                               "file or such a directory")
    text = tmp_path / "prompts.txt"
    text.write_text("hello\n")
    assert refusal(text) == f"{field}: '{text}': expected a .jsonl/.json/.parquet file or a save_to_disk directory"
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "a"}\n{"prompt": \n')
    assert refusal(broken) == f"{broken} line 2: not valid JSON (Expecting value at column 1)"
    nameless = tmp_path / "nameless.jsonl"
    nameless.write_text('{"prompt": "a"}\n{"answer": "b"}\n')
    assert refusal(nameless).startswith(f"{field}: '{nameless}', row ")
    assert "no prompt in row with columns ['answer', 'prompt']" in refusal(nameless)
    one = tmp_path / "one.jsonl"
    one.write_text('{"prompt": "a"}\n')
    assert refusal(one) == (f"{field}: '{one}' has 1 prompt rows; training needs at least 2 (one to train on, one "
                            "to validate with)")
    assert refusal(PROMPTS, val_fraction=0.9) == (
        "field 'data.val_fraction': 0.9 of 4 prompts leaves the training split empty; pick a fraction between "
        "0.25 and 0.75, or more prompts")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["recipe.yaml", "folder", "prompts.txt", "broken.jsonl", "nameless.jsonl", "one.jsonl"])


def test_output_folders_that_cannot_be_used(tmp_path):
    recipe = recipe_dict(tmp_path)
    config = tmp_path / "recipe.yaml"

    def refusal(output_dir, **training) -> str:
        recipe["output_dir"] = str(output_dir)
        recipe["training"].update(training)
        write_recipe(tmp_path, recipe)
        return refused_line(train("--config", config)).removeprefix(f"{config}: ")

    assert refusal(config) == f"field 'output_dir': '{config}' is a file; give a directory to write into"
    assert refusal(config / "run") == (f"field 'output_dir': '{config / 'run'}': '{config}' is a file, so no "
                                       "directory can be made below it")
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("mine")
    assert refusal(home) == (f"field 'output_dir': '{home}' holds notes.txt, which hybridspec train does not write; "
                             "give a new or empty directory, or the output_dir of an earlier run")
    assert refusal(tmp_path / "fresh", resume=True) == (
        f"field 'training.resume': true, but output_dir '{tmp_path / 'fresh'}' holds no checkpoints to resume from; "
        "set it to false for a fresh run")
    assert (home / "notes.txt").read_text() == "mine" and not (tmp_path / "fresh").exists()


def test_output_dir_option_is_checked_like_the_recipe_key(tmp_path):
    config = write_recipe(tmp_path, recipe_dict(tmp_path))
    assert refused_line(train("--config", config, "--output-dir", "")) == (
        "--output-dir: field 'output_dir': String should have at least 1 character (got '')")
    assert refused_line(train("--config", config, "--output-dir", config)) == (
        f"{config}: field 'output_dir': '{config}' is a file; give a directory to write into")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml"]


def test_the_instances_of_issue_32_write_nothing(tmp_path):
    """A misspelled key, broken YAML, a missing prompts file and ``epochs: 0``: each refused, nothing made
    (on main 8c095d8 the first two were tracebacks, the third left target/ and recipe.yaml behind, the
    fourth exited 0 with an untrained final/)."""
    out = tmp_path / "run"
    for edit in (lambda r: r["data"].update(max_promts=r["data"].pop("max_prompts")),
                 lambda r: r["data"].update(prompts=str(tmp_path / "nope.jsonl")),
                 lambda r: r["training"].update(epochs=0)):
        recipe = recipe_dict(tmp_path)
        edit(recipe)
        refused_line(train("--config", write_recipe(tmp_path, recipe)))
        assert not out.exists()
    refused_line(train("--config", write_recipe(tmp_path, "seed: [\n")))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml"]


def test_a_run_that_fails_midway_leaves_whole_artifacts_and_a_rerun_reuses_them(tmp_path, monkeypatch):
    """Training raises after the data was captured: run.json says failed and what the folder holds, no
    final/ or summary.json, no temporary file; the rerun reuses the data and completes."""
    from vllm_hybridspec.train.trainer import DraftTrainer

    config = write_recipe(tmp_path, recipe_dict(tmp_path))
    out = tmp_path / "run"

    def boom(self):
        raise RuntimeError("disk full")

    monkeypatch.setattr(DraftTrainer, "run_training", boom)
    result = train("--config", config)
    assert isinstance(result.exception, RuntimeError)
    run = json.loads((out / "run.json").read_text())
    assert (run["status"], run["error"]) == ("failed", "RuntimeError: disk full")
    assert list(run["contents"]) == ["recipe.yaml", "target", "data"]
    assert sorted(p.name for p in out.iterdir()) == ["data", "recipe.yaml", "run.json", "target"]
    stamp = (out / "data" / "capture.json").stat().st_mtime_ns

    monkeypatch.undo()
    result = train("--config", config)
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines()[0].startswith(f"output_dir {out}: earlier run failed: RuntimeError: disk "
                                                    "full, updated ")
    assert (out / "data" / "capture.json").stat().st_mtime_ns == stamp  # the captured data was reused
    run = json.loads((out / "run.json").read_text())
    assert run["status"] == "complete" and run["error"] is None
    assert list(run["contents"]) == ["recipe.yaml", "target", "data", "metrics.jsonl", "checkpoints", "final",
                                     "summary.json"]
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]


def test_data_capture_that_fails_midway_leaves_no_data_folder(tmp_path, tiny_target, tiny_target_dir, monkeypatch):
    """prepare_data writes beside data/ and renames when done: a failure after some hidden-state files were
    written leaves neither data/ nor its temporary folder, and an earlier data/ stays as it was."""
    import vllm_hybridspec.train.data as data
    from .conftest import LAYERS, data_spec

    model, tokenizer = tiny_target
    calls = {"n": 0}
    real = data.capture_hidden_states

    def flaky(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("disk full")
        return real(*args)

    monkeypatch.setattr(data, "capture_hidden_states", flaky)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "old.txt").write_text("earlier data")
    with pytest.raises(OSError, match="disk full"):
        data.prepare_data(data_spec(max_prompts=4), model, tokenizer, str(tiny_target_dir), LAYERS,
                          tmp_path / "data", seed=0)
    assert calls["n"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]
    assert [p.name for p in (tmp_path / "data").iterdir()] == ["old.txt"]


def recipe_fields(model=None, prefix: str = "") -> list[tuple[str, object]]:
    """``(dotted path, annotation)`` of every leaf field of the recipe schema."""
    import typing

    from pydantic import BaseModel

    from vllm_hybridspec.train.recipe import Recipe

    model = model or Recipe
    found = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        sub = [a for a in (field.annotation, *typing.get_args(field.annotation))
               if isinstance(a, type) and issubclass(a, BaseModel)]
        found += recipe_fields(sub[0], f"{path}.") if sub else [(path, field.annotation)]
    return found


RECIPE_FIELDS = recipe_fields()


@pytest.mark.parametrize("path, annotation", RECIPE_FIELDS, ids=[p for p, _ in RECIPE_FIELDS])
def test_every_recipe_field_refuses_a_value_of_the_wrong_type(tmp_path, path, annotation):
    """A mapping where a scalar or list belongs (the commonest slip: a key indented one level too deep)
    is refused naming the field; for text fields a number is refused (types are not coerced)."""
    from vllm_hybridspec.policy.errors import InputError
    from vllm_hybridspec.train.recipe import Recipe

    recipe = recipe_dict(tmp_path)
    if path.startswith("target.name_or_path") or path == "target.trust_remote_code":
        recipe["target"] = {"name_or_path": "some/model"}
    bad = 7 if annotation in (str, str | None) else {"nested": 1}
    config = write_recipe(tmp_path, set_key(recipe, path, bad))
    with pytest.raises(InputError) as error:
        Recipe.from_yaml(config)
    message = str(error.value)
    assert message.startswith(f"{config}: field '{path}': "), message
    assert "\n" not in message and ("Input should be" in message or "got 7" in message), message


def recipe_bounds() -> list[tuple[str, float, str]]:
    """``(dotted path, a value just outside a declared bound, the relation pydantic names)`` for every
    bounded number of the recipe schema."""
    import dataclasses
    import typing

    import annotated_types as at
    from pydantic import BaseModel

    from vllm_hybridspec.train.recipe import Recipe

    def field(path: str):
        model = Recipe
        *head, last = path.split(".")
        for part in head:
            ann = model.model_fields[part].annotation
            model = next(a for a in (ann, *typing.get_args(ann)) if isinstance(a, type) and issubclass(a, BaseModel))
        return model.model_fields[last]

    found = []
    for path, annotation in RECIPE_FIELDS:
        f = field(path)
        is_int = int in (annotation, *typing.get_args(annotation))
        step = 1 if is_int else 0.5
        for m in f.metadata:
            kinds = {at.Ge: (-step, "greater than or equal to"), at.Gt: (0, "greater than"),
                     at.Le: (step, "less than or equal to"), at.Lt: (0, "less than")}
            for cls, (delta, relation) in kinds.items():
                if isinstance(m, cls):
                    bound = getattr(m, dataclasses.fields(m)[0].name)
                    found.append((path, bound + delta, f"{relation} {bound}"))
    return found


RECIPE_BOUNDS = recipe_bounds()


@pytest.mark.parametrize("path, value, relation", RECIPE_BOUNDS, ids=[f"{p}={v}" for p, v, _ in RECIPE_BOUNDS])
def test_every_recipe_bound_is_enforced(tmp_path, path, value, relation):
    from vllm_hybridspec.policy.errors import InputError
    from vllm_hybridspec.train.recipe import Recipe

    config = write_recipe(tmp_path, set_key(recipe_dict(tmp_path), path, value))
    with pytest.raises(InputError) as error:
        Recipe.from_yaml(config)
    assert str(error.value) == f"{config}: field '{path}': Input should be {relation} (got {value!r})"
